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


def step_seed(seed: int, step: int, rank: int) -> int:
    """A seed for per-step randomness (dropout, augmentation): resumes replay it exactly."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])
