"""Digits whose items carry their index, and a model that logs the indices it trains on: one
line per forward pass on a worker (pid and the batch's ids), so that a test can tell which
samples every step saw."""

import json
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import Dataset


class NumberedDigits(Dataset):
    """noise > 0: each item is augmented with random noise drawn from torch, numpy and random,
    as a user's augmentation would."""

    def __init__(self, split: str = "train", noise: float = 0.0):
        x, y = load_digits(return_X_y=True)
        rows = np.arange(len(y))
        rows = rows[rows % 5 != 0] if split == "train" else rows[rows % 5 == 0]
        self.x = torch.tensor(x[rows] / 16.0, dtype=torch.float32)
        self.y = torch.tensor(y[rows], dtype=torch.long)
        self.noise = noise

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        x = self.x[index]
        if self.noise:
            scale = self.noise * (1 + np.random.rand() + random.random())
            x = x + scale * torch.randn(x.shape)
        return {"x": x, "id": torch.tensor(index)}, self.y[index]


class LoggingMLP(nn.Module):
    def __init__(self, log_dir: str, width: int = 32):
        super().__init__()
        self.log_dir = Path(log_dir)
        self.net = nn.Sequential(nn.Linear(64, width), nn.Tanh(), nn.Linear(width, 10))

    def forward(self, inputs):
        if self.training and dist.is_initialized():  # a worker's training step, not the driver's trial
            line = json.dumps([os.getpid(), inputs["id"].tolist()])
            with open(self.log_dir / f"rank{dist.get_rank()}.jsonl", "a") as f:
                f.write(line + "\n")
        return self.net(inputs["x"])


class LoggingTabular(nn.Module):
    """An MLP over tabular rows (data=parquet) that logs, for each training forward on a
    worker, its pid, the world size and its rows' first feature: the data's row-id column,
    scaled (the same value for the same row in every run of the same data)."""

    def __init__(self, in_features: int, out_features: int, log_dir: str, width: int = 32):
        super().__init__()
        self.log_dir = Path(log_dir)
        self.net = nn.Sequential(nn.Linear(in_features, width), nn.Tanh(),
                                 nn.Linear(width, out_features))

    def forward(self, x):
        if self.training and dist.is_initialized():
            line = json.dumps([os.getpid(), dist.get_world_size(),
                               [round(v, 4) for v in x[:, 0].tolist()]])
            with open(self.log_dir / f"rank{dist.get_rank()}.jsonl", "a") as f:
                f.write(line + "\n")
        return self.net(x)
