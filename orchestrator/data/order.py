"""Which rows a worker trains on at a step: a pure function of (seed, epoch, step).

The global batch at a step is the same whatever the world size; a worker takes every
world_size-th row of it. So a resumed or resized run sees exactly the same data stream.
"""

from __future__ import annotations

import numpy as np


class DataOrder:
    def __init__(self, seed: int, num_rows: int, global_batch: int):
        self.seed = seed
        self.num_rows = num_rows
        self.global_batch = global_batch
        self.steps_per_epoch = max(1, num_rows // global_batch)  # drop the ragged tail
        self._epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:  # one epoch's permutation is cached; steps go forward
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
            self._epoch = epoch
        return self._perm

    def global_batch_rows(self, step: int) -> np.ndarray:
        """Rows of the global batch for the 0-based step."""
        perm = self.permutation(self.epoch_of(step))
        start = (step % self.steps_per_epoch) * self.global_batch
        return perm[start : start + self.global_batch]

    def shard(self, step: int, rank: int, world_size: int) -> np.ndarray:
        return self.global_batch_rows(step)[rank::world_size]

    def largest_share(self, world_size: int) -> int:
        return -(-self.global_batch // world_size)


MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: nearby inputs give unrelated 64-bit outputs."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int, rank: int) -> int:
    """A seed for per-step randomness (dropout, augmentation): resumes replay it exactly.
    Called every step: a few integer operations (numpy's SeedSequence took ~2% of a small
    model's step)."""
    x = _mix64((seed & MASK64) + 0x9E3779B97F4A7C15)
    x = _mix64(x ^ ((step & MASK64) + 0x9E3779B97F4A7C15))
    return _mix64(x ^ ((rank & MASK64) + 0x632BE59BD9B4E019)) >> 1  # < 2**63: any seed API
