from torch import nn


class Regressor(nn.Module):
    """in_features -> width -> width -> 1."""

    def __init__(self, in_features: int = 10, width: int = 32, dropout: float = 0.1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, width), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)
