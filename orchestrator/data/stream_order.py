"""Which rows of streamed parquet data a worker trains on at a step: a pure function of the
data's manifest, the seed, the step and a fixed number of virtual shards.

The row groups are dealt once to ``shards`` virtual shards (balanced by rows; the count is
chosen for the run and kept in its checkpoints). In each epoch a shard permutes its row
groups (seeded by epoch and shard) and reads them in windows of ``window`` row groups, its
rows shuffled within each window. The global batch at a step takes the next rows of every
shard (shard v gives b_v of them, sum = the global batch); a rank trains on the shards
v = rank, rank + world, ... So the global batch at a step is the same at any world size,
a resume at another size continues exactly, and a rank reads only its shards' row groups:
about 1/world of the bytes. This is MosaicML Streaming's idea of canonical nodes, on
plain parquet row groups.

Rows past the shortest shard's share of an epoch wait for the next epoch (another group
order): with row groups of similar size that is under one row group per shard.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from orchestrator.data.manifest import Manifest
from orchestrator.data.row_split import held_out


@dataclass(frozen=True)
class Window:
    shard: int
    epoch: int
    index: int
    groups: tuple[int, ...]  # manifest row-group indices, in reading order
    rows: int  # their training rows


def deal(train_rows: list[int], shards: int) -> list[list[int]]:
    """Row groups to shards, largest first to the shard with the fewest rows (ties: the lower
    shard): balanced, and a function of the manifest alone."""
    load, dealt = [0] * shards, [[] for _ in range(shards)]
    for g in sorted(range(len(train_rows)), key=lambda g: (-train_rows[g], g)):
        v = min(range(shards), key=lambda s: (load[s], s))
        dealt[v].append(g)
        load[v] += train_rows[g]
    return [sorted(gs) for gs in dealt]


class StreamOrder:
    def __init__(self, manifest: Manifest, seed: int, global_batch: int, shards: int,
                 window: int, test_fraction: float, eval_separate: bool):
        self.manifest, self.seed, self.global_batch = manifest, seed, global_batch
        self.shards, self.window = shards, window
        self.test_fraction, self.eval_separate = test_fraction, eval_separate
        self.train_rows = [len(self.train_ids(g)) for g in range(len(manifest.groups))]
        self.num_rows = sum(self.train_rows)
        self.dealt = deal(self.train_rows, shards)
        self.per_step = [global_batch // shards + (v < global_batch % shards) for v in range(shards)]
        self.shard_rows = [sum(self.train_rows[g] for g in gs) for gs in self.dealt]
        self.steps_per_epoch = max(0, min(r // b for r, b in zip(self.shard_rows, self.per_step,
                                                                 strict=True)))
        self._windows: dict[tuple[int, int], list[Window]] = {}
        self._rows: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    # -- the rows ---------------------------------------------------------------------------
    def group_ids(self, g: int) -> np.ndarray:
        grp = self.manifest.groups[g]
        return np.arange(grp.first_row, grp.first_row + grp.rows, dtype=np.int64)

    def train_mask(self, g: int) -> np.ndarray:
        ids = self.group_ids(g)
        if self.eval_separate:
            return np.ones(len(ids), dtype=bool)
        return ~held_out(ids, self.seed, self.test_fraction)

    def train_ids(self, g: int) -> np.ndarray:
        return self.group_ids(g)[self.train_mask(g)]

    @cached_property
    def test_rows(self) -> list[int]:
        return [self.manifest.groups[g].rows - self.train_rows[g] for g in range(len(self.train_rows))]

    # -- the order --------------------------------------------------------------------------
    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def windows(self, shard: int, epoch: int) -> list[Window]:
        """A shard's windows in an epoch: which row groups, how many rows (no ids: those
        are made for the windows in use, so the order's memory does not grow with the data)."""
        key = (shard, epoch)
        with self._lock:  # the read-ahead threads ask too
            if key not in self._windows:
                self._windows[key] = self._plan(shard, epoch)
                if len(self._windows) > 2 * self.shards:  # steps go forward: older epochs are done
                    self._windows.pop(next(iter(self._windows)))
            return self._windows[key]

    def _plan(self, shard: int, epoch: int) -> list[Window]:
        groups = self.dealt[shard]
        rng = np.random.default_rng([self.seed, epoch, shard])
        order = [groups[i] for i in rng.permutation(len(groups))]
        parts = [tuple(order[i:i + self.window]) for i in range(0, len(order), self.window)]
        return [Window(shard, epoch, w, part, sum(self.train_rows[g] for g in part))
                for w, part in enumerate(parts)]

    def rows_of(self, window: Window) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows): the window's training rows in stream order, as global row ids and as
        row numbers in its groups read one after the other (held-out rows included), one
        split of each group for both."""
        key = (window.shard, window.epoch, window.index)
        with self._lock:
            if key in self._rows:
                return self._rows[key]
        groups = [self.manifest.groups[g] for g in window.groups]
        starts = np.cumsum([0, *(grp.rows for grp in groups)])
        rows = np.concatenate([np.flatnonzero(self.train_mask(g)) + start
                               for g, start in zip(window.groups, starts[:-1], strict=True)])
        rng = np.random.default_rng([self.seed, window.epoch, window.shard, window.index, 1])
        rows = rows[rng.permutation(len(rows))]
        # A row's id from its place: its group's first id plus its place in the group.
        at = np.searchsorted(starts, rows, side="right") - 1 if len(groups) > 1 else 0
        first_ids = np.array([grp.first_row for grp in groups], dtype=np.int64)
        result = (rows - starts[at] + first_ids[at], rows)
        with self._lock:
            self._rows[key] = result
            if len(self._rows) > 3 * self.shards:  # a shard's current, next and last windows
                self._rows.pop(next(iter(self._rows)))
        return result

    def span(self, shard: int, step: int) -> tuple[int, int, int]:
        """(epoch, first, last): shard's rows first..last-1 of its epoch stream at ``step``."""
        epoch = self.epoch_of(step)
        first = (step % self.steps_per_epoch) * self.per_step[shard]
        return epoch, first, first + self.per_step[shard]

    def chunk(self, shard: int, step: int) -> np.ndarray:
        """The row ids shard ``shard`` gives the global batch at ``step``."""
        epoch, first, last = self.span(shard, step)
        parts, start = [], 0
        for window in self.windows(shard, epoch):
            end = start + window.rows
            if end > first and start < last:
                ids, _ = self.rows_of(window)
                parts.append(ids[max(first - start, 0):min(last, end) - start])
            if end >= last:
                break
            start = end
        return np.concatenate(parts)

    def shards_of(self, rank: int, world_size: int) -> list[int]:
        return list(range(rank, self.shards, world_size))

    def global_batch_rows(self, step: int) -> np.ndarray:
        return np.concatenate([self.chunk(v, step) for v in range(self.shards)])

    def shard(self, step: int, rank: int, world_size: int) -> np.ndarray:
        return np.concatenate([self.chunk(v, step) for v in self.shards_of(rank, world_size)])

    def largest_share(self, world_size: int) -> int:
        return max(sum(self.per_step[v] for v in self.shards_of(rank, world_size))
                   for rank in range(world_size))

    def position(self) -> dict:
        """What a checkpoint keeps of the order (with the step): a resume checks it."""
        return {"streamed": True, "shards": self.shards, "window": self.window,
                "manifest": self.manifest.summary()}
