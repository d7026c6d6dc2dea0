"""A small convolutional network for 8x8 grey images."""

from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 16, classes: int = 10, dropout: float = 0.1):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout),
                                  nn.Linear(2 * channels * 16, classes))

    def pipeline_layers(self) -> list[str]:
        """Its forward as a chain (trainer.pipeline.degree=2: the convolutions, then the head)."""
        return ["features", "head"]

    def forward(self, images):
        return self.head(self.features(images))
