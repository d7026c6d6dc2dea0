"""Default models for the DDP trainer. Any module class or factory taking
(in_features, num_classes, **kwargs) plugs in through trainer.model._target_."""

from __future__ import annotations

from torch import nn


class MLP(nn.Sequential):
    def __init__(self, in_features: int, num_classes: int, hidden=(128, 64), dropout: float = 0.0):
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)
