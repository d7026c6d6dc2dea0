"""scikit-learn's handwritten digits as 1x8x8 images: a real image dataset that needs no
download. A map-style dataset: (image, label) items, a seeded train/test split."""

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch.utils.data import Dataset


class DigitImages(Dataset):
    def __init__(self, split: str = "train", test_fraction: float = 0.2, seed: int = 0):
        images, labels = load_digits(return_X_y=True)
        order = np.random.default_rng(seed).permutation(len(labels))
        cut = int(len(labels) * test_fraction)
        rows = order[cut:] if split == "train" else order[:cut]
        self.images = torch.tensor(images[rows] / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
        self.labels = torch.tensor(labels[rows], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index]
