"""A real text corpus present on every machine with Python: the standard library's own source
files, as bytes (a vocabulary of 256). Windows of seq_len bytes; the target is the same
window shifted by one. The last test_fraction of the corpus is held out."""

import math
import sysconfig
from collections import Counter
from pathlib import Path

import torch
from torch.utils.data import Dataset


def corpus(max_bytes: int) -> bytes:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = bytearray()
    for path in sorted(stdlib.glob("*.py")):  # a fixed order: the same corpus on every rank
        text += path.read_bytes()
        if len(text) >= max_bytes:
            break
    return bytes(text[:max_bytes])


def split_corpus(max_bytes: int, test_fraction: float) -> tuple[bytes, bytes]:
    text = corpus(max_bytes)
    cut = int(len(text) * (1 - test_fraction))
    return text[:cut], text[cut:]


class SourceBytes(Dataset):
    def __init__(self, split: str = "train", seq_len: int = 64, max_bytes: int = 400_000,
                 test_fraction: float = 0.1):
        train, test = split_corpus(max_bytes, test_fraction)
        text = train if split == "train" else test
        self.data = torch.tensor(list(text), dtype=torch.long)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, index: int):
        start = index * self.seq_len
        window = self.data[start:start + self.seq_len + 1]
        return window[:-1], window[1:]


def unigram_perplexity(max_bytes: int = 400_000, test_fraction: float = 0.1) -> float:
    """The perplexity of the held-out bytes under the training bytes' frequencies (add-one
    smoothed): what a model that ignores context achieves."""
    train, test = split_corpus(max_bytes, test_fraction)
    counts, total = Counter(train), len(train) + 256
    nll = -sum(math.log((counts[b] + 1) / total) for b in test) / len(test)
    return math.exp(nll)
