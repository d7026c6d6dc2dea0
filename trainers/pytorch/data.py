"""Batches for the PyTorch trainer: the orchestrator's order (ctx.batches: the global batch of a
step is fixed by (seed, step) whatever the world size), cut into micro-batches, through a
torch DataLoader (prefetching processes, pinned memory on GPU).

Every rank runs the same number of micro-batches at a step (FSDP gathers parameters in each
forward, so the ranks' forwards must pair up): a rank with fewer rows splits them finer, and a
rank with none runs a padding micro-batch whose loss weighs zero.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from orchestrator.data.order import step_seed
from orchestrator.worker_api import Batches


class TensorRows(Dataset):
    """Rows of in-memory tensors as a map-style dataset, fetched a batch at a time (torch's
    DataLoader calls __getitems__ with a micro-batch's indices): one gather, no collating."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]

    def __getitems__(self, indices: list[int] | np.ndarray):
        # An index array is shared, not converted: torch.as_tensor of a list of 256 indices
        # took ~0.1 ms, 3% of a small model's step.
        rows = torch.from_numpy(indices) if isinstance(indices, np.ndarray) else torch.as_tensor(indices)
        return self.x[rows], self.y[rows]


def already_batched(batch):
    """The collate function of TensorRows: __getitems__ returned the batch itself."""
    return batch


def tabular(dataset, standardize: Callable) -> tuple[TensorRows, TensorRows]:
    """data=digits|synthetic|parquet (ctx.dataset()) as train and eval datasets."""
    x_train, x_test = (torch.from_numpy(x) for x in standardize(dataset.x_train, dataset.x_test))
    y_train, y_test = torch.from_numpy(dataset.y_train), torch.from_numpy(dataset.y_test)
    return TensorRows(x_train, y_train), TensorRows(x_test, y_test)


@dataclass(frozen=True)
class MicroBatch:
    rows: np.ndarray  # dataset indices
    weight: float  # 1.0, or 0.0 for padding (keeps the ranks' forwards paired)


class StepPlan:
    """This rank's micro-batches at every step, and the batch sampler that feeds them."""

    def __init__(self, batches: Batches, world_size: int, micro_batch_size: int | None):
        self.batches, self.world_size, self.micro = batches, world_size, micro_batch_size
        self._last: tuple[int, list[MicroBatch]] | None = None

    def micro_batches(self, step: int) -> list[MicroBatch]:
        # Asked twice a step (by the loop, and by whatever fetches the batches): computed once.
        if self._last is None or self._last[0] != step:
            self._last = (step, self._split(step))
        return self._last[1]

    def _split(self, step: int) -> list[MicroBatch]:
        rows = self.batches.rows(step)
        most = self.batches.largest_share
        count = max(1, math.ceil(most / self.micro)) if self.micro else 1
        if len(rows) == 0:
            return [MicroBatch(self.batches.global_rows(step)[:1], 0.0)] * count
        # No micro-batch of one row beside larger ones (BatchNorm refuses one row in training):
        # a smaller share is cut into parts of 2 rows or more, and padded up to the count.
        parts = max(1, min(count, len(rows) // 2))
        pad = MicroBatch(rows[:2], 0.0)
        return [MicroBatch(part, 1.0) for part in np.array_split(rows, parts)] + \
            [pad] * (count - parts)

    def rows(self, start: int, total: int) -> Iterator[np.ndarray]:
        """The dataset indices of every micro-batch of steps start..total-1, in order."""
        for step in range(start, total):
            for micro in self.micro_batches(step):
                yield micro.rows


EVERY_RANK = -1  # step_seed's rank for a seed that is the same on every rank


class SeededRows(list):
    """A micro-batch's dataset indices and its step's seed."""

    seed: int | None = None


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.random.default_generator.manual_seed(seed)


class SeededFetch(Dataset):
    """A user's dataset whose items draw their randomness (augmentation) from torch, random
    and numpy seeded by (seed, step, item): the same numbers after a resume, at any world size,
    whichever DataLoader process fetched them and however many it fetched before (unseeded, a
    worker process's draws depend on all of that). A dataset that fetches a batch at once
    (``__getitems__``) is seeded once per micro-batch, by its first item: exact on a resume at
    the same world size."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.dataset[index]

    def __getitems__(self, rows: list[int]):
        seed = getattr(rows, "seed", None)
        getitems = getattr(self.dataset, "__getitems__", None)
        if seed is None:
            return getitems(rows) if getitems else [self.dataset[i] for i in rows]
        if getitems:
            seed_all(step_seed(seed, rows[0], 0))
            return getitems(rows)
        items = []
        for i in rows:
            seed_all(step_seed(seed, i, 0))
            items.append(self.dataset[i])
        return items


class _Sampler:
    """A re-iterable batch sampler over a plan's steps (DataLoader iterates it once); each
    micro-batch carries its step's seed (``seed_of(step)``)."""

    def __init__(self, plan: StepPlan, start: int, total: int, seed_of: Callable[[int], int]):
        self.plan, self.start, self.total, self.seed_of = plan, start, total, seed_of

    def __iter__(self) -> Iterator[SeededRows]:
        return seeded_rows(self.plan, self.start, self.total, self.seed_of)


def seeded_rows(plan: StepPlan, start: int, total: int,
                seed_of: Callable[[int], int]) -> Iterator[SeededRows]:
    for step in range(start, total):
        for micro in plan.micro_batches(step):
            rows = SeededRows(micro.rows.tolist())
            rows.seed = seed_of(step)
            yield rows


@contextmanager
def loop_randomness_kept():
    """An in-process fetch leaves the loop's own random state (torch's: its dropout, seeded
    every step) as it was, as a fetch in a DataLoader process does. random's and numpy's are
    not the loop's (it never seeds them); keeping them too cost ~95 us a micro-batch."""
    state = torch.random.get_rng_state()
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def loader(dataset: Dataset, batch_sampler, collate: Callable, num_workers: int,
           device: torch.device, seed: int) -> DataLoader:
    return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate,
                      num_workers=num_workers, pin_memory=device.type == "cuda",
                      generator=torch.Generator().manual_seed(seed),
                      worker_init_fn=temporary_files_of_its_own)


LOADER_DIR = "loader"
SOCKET_PATH_ROOM = 70  # AF_UNIX paths end at 107 bytes; multiprocessing adds ~32 below ours


def temporary_files_of_its_own(worker_id: int) -> None:
    """In each DataLoader process: its temporary files (multiprocessing's pymp-* folder with the
    socket it shares tensors through) go in a private folder of its own (private_dir.py), which
    it removes as it ends. A process killed with its rank (a preemption, a stopped run) would
    leave them in the shared temporary folder; this folder is removed once the process is gone,
    by the next DataLoader process or command on the node (remove_dead_dirs)."""
    from multiprocessing.util import Finalize

    from orchestrator.private_dir import process_dir

    try:
        folder = process_dir(LOADER_DIR)
    except OSError:  # not private: the run's other checks say so; the default place serves
        return
    if len(str(folder)) > SOCKET_PATH_ROOM:  # a long ORCHESTRATOR_PRIVATE_DIR
        folder.rmdir()
        return
    tempfile.tempdir = str(folder)
    # After multiprocessing's own removal of its pymp-* folder (exitpriority -100).
    Finalize(None, shutil.rmtree, args=(str(folder),), kwargs={"ignore_errors": True},
             exitpriority=-200)


def step_batches(dataset: Dataset, plan: StepPlan, start: int, total: int, collate: Callable,
                 num_workers: int, device: torch.device, seed_of: Callable[[int], int]) -> Iterator:
    """The micro-batches of steps start..total-1, in order, as the loop consumes them.
    ``seed_of(step)``: the step's seed, the same on every rank (SeededFetch)."""
    if num_workers == 0 and device.type == "cpu":
        return fetched(dataset, plan, start, total, collate, seed_of)
    return iter(loader(SeededFetch(dataset), _Sampler(plan, start, total, seed_of), collate,
                       num_workers, device, seed_of(start)))


def fetched(dataset: Dataset, plan: StepPlan, start: int, total: int, collate: Callable,
            seed_of: Callable[[int], int]) -> Iterator:
    """What a DataLoader with no worker processes and no pinned memory does (fetch a
    micro-batch's items, collate them, in the loop's own thread), without its per-batch
    bookkeeping; in-memory rows are gathered by the index array itself (they draw nothing:
    no seeding)."""
    if isinstance(dataset, TensorRows):
        for rows in plan.rows(start, total):
            yield collate(dataset.__getitems__(rows))
        return
    seeded = SeededFetch(dataset)
    for rows in seeded_rows(plan, start, total, seed_of):
        with loop_randomness_kept():
            items = seeded.__getitems__(rows)
        yield collate(items)


def streamed_feed(batches, plan: StepPlan, start: int, total: int) -> Iterator:
    """The micro-batches of steps start..total-1 from streamed data (ctx.stream()): each
    step's rows as read, cut where the plan cuts them (its padding: the step's first rows)."""
    for step, (ids, x, y) in zip(range(start, total), batches.read(start, total), strict=True):
        x, y, offset = torch.from_numpy(x), torch.from_numpy(y), 0
        for micro in plan.micro_batches(step):
            if not micro.weight:
                yield x[:2], y[:2]
                continue
            n = len(micro.rows)
            if not np.array_equal(micro.rows, ids[offset:offset + n]):
                raise RuntimeError(f"streamed rows out of order at step {step}")
            yield x[offset:offset + n], y[offset:offset + n]
            offset += n


def eval_shards(size: int, rank: int, world_size: int, batch_size: int) -> list[MicroBatch]:
    """This rank's share of the held-out rows (every world_size-th), in batches; every rank
    gets the same number of batches (padding batches weigh zero)."""
    rows = np.arange(rank, size, world_size)
    count = math.ceil(math.ceil(size / world_size) / batch_size)
    parts = [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
    pad = MicroBatch(np.arange(min(1, size)), 0.0)
    return [MicroBatch(p, 1.0) for p in parts] + [pad] * (count - len(parts))


def to_device(batch: Any, device: torch.device) -> Any:
    """A collated batch on the device, in its own type: tensors inside dicts and other
    mappings (a tokenizer's BatchEncoding), lists, tuples and named tuples, dataclasses; an
    object of another kind with its own ``to(device)`` (a graph library's batch) moves itself."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        if type(batch) is dict or not isinstance(batch, MutableMapping):
            return moved
        out = copy.copy(batch)
        out.update(moved)
        return out
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: to_device(getattr(batch, f.name), device)
                                             for f in dataclasses.fields(batch) if f.init})
    if callable(getattr(batch, "to", None)) and not isinstance(batch, (str, bytes, np.ndarray)):
        return batch.to(device)
    return batch


def collate_function(node: dict | None) -> Callable:
    """data.collate_fn: a function by import path (keyword arguments bind with partial)."""
    if not node or node.get("_target_") is None:
        return default_collate
    from hydra.utils import instantiate

    from trainers.pytorch.config import locate

    if set(node) <= {"_target_", "_partial_"}:
        return locate(node["_target_"])
    return instantiate({**node, "_partial_": True})
