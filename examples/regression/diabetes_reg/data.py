"""scikit-learn's diabetes data (442 patients, 10 measurements, disease progression after a
year): a small real regression problem. The target is standardised with the training rows'
mean and spread; a seeded train/test split."""

import numpy as np
import torch
from sklearn.datasets import load_diabetes
from torch.utils.data import Dataset


class Diabetes(Dataset):
    def __init__(self, split: str = "train", test_fraction: float = 0.2, seed: int = 0):
        x, y = load_diabetes(return_X_y=True, scaled=False)
        order = np.random.default_rng(seed).permutation(len(y))
        cut = int(len(y) * test_fraction)
        train, rows = order[cut:], (order[cut:] if split == "train" else order[:cut])
        x_mean, x_std = x[train].mean(0), x[train].std(0)
        y_mean, y_std = y[train].mean(), y[train].std()
        self.x = torch.tensor((x[rows] - x_mean) / x_std, dtype=torch.float32)
        self.y = torch.tensor((y[rows] - y_mean) / y_std, dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]
