"""Parts a user might get wrong on a first try: the driver must say so in one line before Ray
starts."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class RaggedItems(Dataset):
    """Items of different lengths: torch's default collate cannot stack them."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int):
        return torch.ones(index + 1), torch.tensor(0)


class FiveByTwo(nn.Module):
    """An output of shape (batch, 5, 2): cross entropy against class ids cannot take it."""

    def __init__(self, in_features: int = 64):
        super().__init__()
        self.linear = nn.Linear(in_features, 10)

    def forward(self, x):
        return self.linear(x).reshape(-1, 5, 2)


def per_sample_loss(output, target):
    return F.cross_entropy(output, target, reduction="none")  # not reduced to one number


class DoubleItems(Dataset):
    """A held-out set read with numpy (float64), where the training set is float32 tensors."""

    def __init__(self, features: int = 4):
        import numpy as np

        self.x = np.random.default_rng(0).normal(size=(6, features))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], 0


class UnusedHead(nn.Module):
    """A second head the forward never calls (an auxiliary one, for later): DDP waits for its
    gradients."""

    def __init__(self, in_features: int = 4, out_features: int = 3):
        super().__init__()
        self.body = nn.Linear(in_features, out_features)
        self.aux = nn.Linear(in_features, 1)

    def forward(self, x):
        return self.body(x)

    def loss(self, x, y):
        return F.cross_entropy(self.body(x), y)


def method_step(model, batch):
    """A step function that calls a method of the model other than its forward."""
    x, y = batch
    return model.loss(x, y)
