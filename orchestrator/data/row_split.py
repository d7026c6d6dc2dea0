"""The train/test split of streamed data, decided per row from (seed, row id) alone: no worker
must read anything to know which of its rows are held out, and the split is the same at any
world size and in every attempt."""

from __future__ import annotations

import numpy as np

try:  # built at install (setup.py); without a C compiler, numpy's passes below
    from orchestrator.data._rows import held_out as compiled_held_out
except ImportError:
    compiled_held_out = None

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer over an array (uint64 arithmetic wraps, as it must)."""
    with np.errstate(over="ignore"):
        return _mix_wrapping(x)


def _mix_wrapping(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def held_out(row_ids: np.ndarray, seed: int, fraction: float) -> np.ndarray:
    """A boolean mask: True for the rows of the test split (about ``fraction`` of them).
    Compiled where the install built it (orchestrator/data/_rows.c: the same bits, a fifth of
    the time; the reader asks it for every window)."""
    with np.errstate(over="ignore"):
        key = _mix(np.uint64(seed & (2**64 - 1)) + _GOLDEN)
        if compiled_held_out is not None:
            mask = np.empty(len(row_ids), dtype=bool)
            compiled_held_out(np.ascontiguousarray(row_ids, dtype=np.int64), int(key),
                              float(fraction), mask)
            return mask
        h = _mix((row_ids.astype(np.uint64) + _GOLDEN) ^ key)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53) < fraction


def train_counts(first_rows: list[int], rows: list[int], seed: int, fraction: float,
                 eval_separate: bool) -> tuple[list[int], list[int]]:
    """(train rows, test rows) of every row group. With data.eval_path every row trains."""
    if eval_separate:
        return list(rows), [0] * len(rows)
    train, test = [], []
    for first, n in zip(first_rows, rows, strict=True):
        t = int(held_out(np.arange(first, first + n, dtype=np.int64), seed, fraction).sum())
        train.append(n - t)
        test.append(t)
    return train, test
