"""A rank's share of streamed parquet data, read a window of row groups at a time.

Reading and decoding run in background threads (pyarrow releases the GIL), one window ahead
per shard, so the step rarely waits for the disk or S3; a rank holds at most two windows per
shard it owns, whatever the size of the data. Every byte read is counted (``bytes_read``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from orchestrator.data.manifest import Manifest
from orchestrator.data.stream_order import StreamOrder


@dataclass(frozen=True)
class Decoding:
    """How columns become arrays, decided once on the driver (orchestrator/data/streaming.py)."""

    features: tuple[str, ...]
    label: str
    classes: tuple | None  # the sorted label values of a classification (-> 0..k-1)
    mean: np.ndarray | None  # feature scaling from a sample of the training rows
    std: np.ndarray | None

    def decode(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        x = np.empty((table.num_rows, len(self.features)), dtype=np.float32)
        for i, name in enumerate(self.features):
            x[:, i] = table[name].to_numpy(zero_copy_only=False)
        if self.mean is not None:  # the neural trainers' scaling
            x -= self.mean
            x /= self.std
        labels = table[self.label].to_numpy(zero_copy_only=False)
        if self.classes is None:
            return x, labels.astype(np.float32)
        return x, np.searchsorted(np.asarray(self.classes), labels).astype(np.int64)


class CountingFile:
    """A read-only file that counts the bytes read through it (for bytes_read)."""

    def __init__(self, raw, counter: list[int], lock: threading.Lock):
        self.raw, self.counter, self.lock = raw, counter, lock
        self.closed = False

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        with self.lock:
            self.counter[0] += len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def size(self) -> int:
        return self.raw.size()

    def close(self) -> None:
        self.closed = True
        self.raw.close()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


class GroupReader:
    """Row groups of one manifest read through its filesystem, their bytes counted."""

    def __init__(self, manifest: Manifest, fs, decoding: Decoding):
        self.manifest, self.fs, self.decoding = manifest, fs, decoding
        self._count, self._lock = [0], threading.Lock()
        self.columns = [*decoding.features, decoding.label]
        self._footers: dict[int, pq.FileMetaData] = {}

    @property
    def bytes_read(self) -> int:
        return self._count[0]

    def read(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        grp = self.manifest.groups[g]
        path = self.manifest.files[grp.file].path
        raw = self.fs.open_input_file(path)
        with pa.PythonFile(CountingFile(raw, self._count, self._lock), mode="r") as handle:
            # A file's footer is read once (pyarrow reads its last 64 KiB for it): a row
            # group of a file already seen costs its own bytes only.
            parquet = pq.ParquetFile(handle, metadata=self._footers.get(grp.file))
            self._footers[grp.file] = parquet.metadata
            table = parquet.read_row_group(grp.index, columns=self.columns)
        return self.decoding.decode(table)


class ShardCursor:
    """One shard's stream from a step on: its windows' rows in stream order."""

    def __init__(self, order: StreamOrder, reader: GroupReader, shard: int,
                 pool: ThreadPoolExecutor):
        self.order, self.reader, self.shard, self.pool = order, reader, shard, pool
        self._loaded: dict[tuple[int, int], Future] = {}

    def _window_data(self, epoch: int, w: int) -> Future:
        key = (epoch, w)
        if key not in self._loaded:
            self._loaded[key] = self.pool.submit(self._read_window, epoch, w)
        return self._loaded[key]

    def _read_window(self, epoch: int, w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        window = self.order.windows(self.shard, epoch)[w]
        xs, ys = [], []
        for g in window.groups:
            x, y = self.reader.read(g)
            keep = self.order.train_mask(g)
            xs.append(x[keep])
            ys.append(y[keep])
        x, y = np.concatenate(xs), np.concatenate(ys)
        return window.ids, x[window.perm], y[window.perm]

    def _next_window(self, epoch: int, w: int) -> tuple[int, int]:
        if w + 1 < len(self.order.windows(self.shard, epoch)):
            return epoch, w + 1
        return epoch + 1, 0

    def take(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, x, y) this shard gives the global batch at ``step``."""
        epoch, first, last = self.order.span(self.shard, step)
        parts, start, w = [], 0, 0
        windows = self.order.windows(self.shard, epoch)
        while w < len(windows):
            end = start + len(windows[w].ids)
            if end > first:
                ids, x, y = self._window_data(epoch, w).result()
                lo, hi = first - start if first > start else 0, min(last, end) - start
                parts.append((ids[lo:hi], x[lo:hi], y[lo:hi]))
                self._window_data(*self._next_window(epoch, w))  # prefetch the next window
            if end >= last:
                break
            start, w = end, w + 1
        # Windows before this step's first are done with.
        for key in [k for k in self._loaded if k < (epoch, w)]:
            del self._loaded[key]
        return tuple(np.concatenate(col) for col in zip(*parts, strict=True))


class RankStream:
    """This rank's rows of the global batch, step by step (ids, x, y), read ahead."""

    def __init__(self, order: StreamOrder, reader: GroupReader, rank: int, world_size: int,
                 threads: int = 2):
        self.reader = reader
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="parquet-read")
        self.cursors = [ShardCursor(order, reader, v, self._pool)
                        for v in order.shards_of(rank, world_size)]

    def step(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        taken = [c.take(step) for c in self.cursors]
        return tuple(np.concatenate(col) for col in zip(*taken, strict=True))

    def steps(self, start: int, total: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        try:
            for s in range(start, total):
                yield self.step(s)
        finally:
            self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class EvalShare:
    """This rank's held-out rows in batches: the test rows of its shards' row groups (or, with
    data.eval_path, every world_size-th row group of that data). Every rank yields the same
    number of batches (FSDP pairs the ranks' forwards): padding batches weigh 0."""

    def __init__(self, reader: GroupReader, groups: list[int], masks, batch_size: int, count: int):
        self.reader, self.groups, self.masks = reader, groups, masks
        self.batch_size, self.count = batch_size, count

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray, float]]:
        given, xs, ys, one = 0, [], [], None
        for g in self.groups:
            x, y = self.reader.read(g)
            keep = self.masks(g)
            xs.append(x[keep])
            ys.append(y[keep])
            x, y = np.concatenate(xs), np.concatenate(ys)
            while len(y) >= self.batch_size:
                yield x[:self.batch_size], y[:self.batch_size], 1.0
                one = (x[:1], y[:1])
                x, y, given = x[self.batch_size:], y[self.batch_size:], given + 1
            xs, ys = [x], [y]
        if xs and len(ys[0]):
            yield xs[0], ys[0], 1.0
            one, given = (xs[0][:1], ys[0][:1]), given + 1
        for _ in range(self.count - given):  # a padding batch: a real row, weighing nothing
            yield one[0], one[1], 0.0
