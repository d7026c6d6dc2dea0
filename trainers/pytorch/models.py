"""The default model: an MLP over rows of numbers. Any nn.Module class or factory plugs in
through trainer.model._target_, with the keyword arguments the YAML gives it."""

from __future__ import annotations

from torch import nn


class MLP(nn.Sequential):
    def __init__(self, in_features: int, out_features: int, hidden=(128, 64), dropout: float = 0.0):
        if in_features is None or out_features is None:  # data=torch leaves them to the user
            raise ValueError(f"in_features={in_features}, out_features={out_features}: give both "
                             "(trainer.model.in_features=...) or your own model")
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, out_features))
        super().__init__(*layers)
