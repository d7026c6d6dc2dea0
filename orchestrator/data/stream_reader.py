"""A rank's share of streamed parquet data, read a window of row groups at a time.

Reading and decoding run in background threads (pyarrow and the compiled decode, _rows.c,
release the GIL), READ_AHEAD windows ahead per shard, so the step rarely waits for the disk or
S3; a rank holds at most READ_AHEAD + 2 windows per shard it owns (those read ahead, the
current one, and the one the step before still holds a view of), whatever the size of the
data. Every byte read is counted (``bytes_read``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from orchestrator.data.manifest import Manifest
from orchestrator.data.stream_order import StreamOrder

try:  # built at install (setup.py); without a C compiler, numpy's blocks below
    from orchestrator.data._rows import rows_from_columns
except ImportError:
    rows_from_columns = None


@dataclass(frozen=True)
class Decoding:
    """How columns become arrays, decided once on the driver (orchestrator/data/streaming.py)."""

    features: tuple[str, ...]
    label: str
    classes: tuple | None  # the sorted label values of a classification (-> 0..k-1)
    mean: np.ndarray | None  # feature scaling from a sample of the training rows
    std: np.ndarray | None

    def decode(self, tables: pa.Table | list[pa.Table],
               rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(features, labels) of the tables' rows one after the other, then ``rows`` of them
        in that order (all of them when None): features row-major float32, scaled; labels
        class indices or float32. Several tables (a window's row groups) go straight into
        one array, not concatenated first (a copy of every column)."""
        tables = [tables] if isinstance(tables, pa.Table) else tables
        x = row_major(tables, self.features, self.mean, self.std, rows)
        labels = np.concatenate([t[self.label].to_numpy(zero_copy_only=False) for t in tables])
        if rows is not None:
            labels = labels[rows]
        if self.classes is None:
            return x, labels.astype(np.float32)
        if self.classes_are_indices and labels.dtype.kind in "iu":  # 0..k-1 already: as they are
            return x, labels.astype(np.int64, copy=False)
        return x, np.searchsorted(np.asarray(self.classes), labels).astype(np.int64)

    @property
    def classes_are_indices(self) -> bool:
        return self.classes is not None and list(self.classes) == list(range(len(self.classes)))


# Windows read ahead per shard, by two threads: one kept only one core busy (0.34 against
# 0.43 of a bare read); three keep both busy through a slow window (0.79 against 0.76 with
# two, data_scale bench, 15 interleaved runs), for one window more of memory.
READ_AHEAD = 3
BLOCK_ROWS = 16384  # 4 MiB of 64 float32 features: stays in the cache while its columns land


def row_major(tables: pa.Table | list[pa.Table], names, mean: np.ndarray | None = None,
              std: np.ndarray | None = None, rows: np.ndarray | None = None) -> np.ndarray:
    """The tables' columns as one (rows, columns) float32 array, the tables' rows one after
    the other, scaled by (mean, std) when given; then only ``rows`` of them (distinct row
    numbers), in that order: compiled, each row lands there at once (no copy to gather)."""
    tables = [tables] if isinstance(tables, pa.Table) else tables
    total = sum(t.num_rows for t in tables)
    x = arrow_memory((total if rows is None else len(rows), len(names)))
    if rows_from_columns is None:  # numpy's blocks, then a gather of whole rows
        whole = x if rows is None else np.empty((total, len(names)), dtype=np.float32)
        start = 0
        for table in tables:
            columns = [table[name].to_numpy(zero_copy_only=False) for name in names]
            fill_rows(columns, whole[start:start + table.num_rows], mean, std)
            start += table.num_rows
        return x if rows is None else np.take(whole, rows, axis=0)
    dest = None
    if rows is not None:  # where each row goes; held-out rows go nowhere (-1)
        dest = np.full(total, -1, dtype=np.int64)
        dest[rows] = np.arange(len(rows))
    start = 0
    for table in tables:
        end = start + table.num_rows
        columns = [np.ascontiguousarray(table[name].to_numpy(zero_copy_only=False),
                                        dtype=np.float32) for name in names]
        if dest is None:
            rows_from_columns(columns, x[start:end], mean, std)
        else:
            rows_from_columns(columns, x, mean, std, dest[start:end])
        start = end
    return x


def arrow_memory(shape: tuple[int, int]) -> np.ndarray:
    """An uninitialised float32 array in Arrow's memory pool, the one the reads use: a window
    freed is memory the next one reuses, where numpy's large arrays come from the kernel each
    time, zeroed page by page (0.95 of the time of an epoch's reads, data_scale bench). The
    array keeps its buffer alive, and is writable."""
    values = shape[0] * shape[1]
    buffer = pa.allocate_buffer(max(values, 1) * 4)
    return np.frombuffer(buffer, dtype=np.float32, count=values).reshape(shape)


def fill_rows(columns: list[np.ndarray], x: np.ndarray, mean: np.ndarray | None,
              std: np.ndarray | None) -> None:
    """numpy's way, a block of rows at a time: a column written into a whole array at once
    touches every row's cache line once per column; into a block, the block stays in the
    cache while its columns land and it is scaled (half the time of a column at a time)."""
    for start in range(0, len(x), BLOCK_ROWS):
        block = x[start:start + BLOCK_ROWS]
        for i, column in enumerate(columns):
            block[:, i] = column[start:start + BLOCK_ROWS]
        if mean is not None:  # the neural trainers' scaling
            block -= mean
            block /= std


class GroupReader:
    """Row groups of one manifest read through its filesystem, their bytes counted: the
    column chunks a read asks for (their stored sizes), plus each file's footer the first
    time (pyarrow reads its last 64 KiB for it)."""

    FOOTER_READ = 64 * 1024
    FOOTERS_KEPT = 64

    def __init__(self, manifest: Manifest, fs, decoding: Decoding):
        self.manifest, self.fs, self.decoding = manifest, fs, decoding
        self._count, self._lock = 0, threading.Lock()
        self.columns = [*decoding.features, decoding.label]
        # The newest footers read (a footer of a wide file is ~1 KiB a column): a share of
        # 10^4 small files would otherwise hold every one of them for the whole run.
        self._footers: OrderedDict[int, pq.FileMetaData] = OrderedDict()
        self._local = isinstance(fs, pafs.LocalFileSystem)

    @property
    def bytes_read(self) -> int:
        return self._count

    def table(self, g: int, use_threads: bool = False) -> pa.Table:
        grp = self.manifest.groups[g]
        path = self.manifest.files[grp.file].path
        with self._lock:
            footer = self._footers.get(grp.file)
        with self.fs.open_input_file(path) as handle:
            # A file's footer is read once: a row group of a file already seen costs its own
            # bytes only. The stream's windows are read one thread each: the reader's threads
            # read two side by side (pyarrow's column threads on top of them: 0.64 against
            # 0.70 of a bare read, data_scale bench). Away from the local disk, a group's
            # column chunks are fetched together (pre_buffer), not one request after another.
            parquet = pq.ParquetFile(handle, metadata=footer, pre_buffer=not self._local)
            table = parquet.read_row_group(grp.index, columns=self.columns, use_threads=use_threads)
        meta = parquet.metadata
        rg = meta.row_group(grp.index)
        wanted = set(self.columns)
        read = sum(rg.column(c).total_compressed_size for c in range(rg.num_columns)
                   if rg.column(c).path_in_schema in wanted)
        with self._lock:
            self._footers[grp.file] = meta
            self._footers.move_to_end(grp.file)
            while len(self._footers) > self.FOOTERS_KEPT:
                self._footers.popitem(last=False)
            self._count += read + (0 if footer else min(self.FOOTER_READ, self.manifest.files[grp.file].size))
        return table

    def read(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """A whole group decoded, in the caller's thread (the held-out pass): pyarrow's
        threads read its columns."""
        return self.decoding.decode(self.table(g, use_threads=True))


class ShardCursor:
    """One shard's stream from a step on: its windows' rows in stream order."""

    def __init__(self, order: StreamOrder, reader: GroupReader, shard: int,
                 pool: ThreadPoolExecutor):
        self.order, self.reader, self.shard, self.pool = order, reader, shard, pool
        self.total: int | None = None  # the step the stream ends before
        self._loaded: dict[tuple[int, int], Future] = {}
        self._scanned: tuple[int, int, int] | None = None  # (epoch, window, its first row)
        self._ahead_of: tuple[int, int] | None = None  # the window read ahead from last

    def _window_data(self, epoch: int, w: int) -> Future:
        key = (epoch, w)
        if key not in self._loaded:
            self._loaded[key] = self.pool.submit(self._read_window, epoch, w)
        return self._loaded[key]

    def _read_window(self, epoch: int, w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        window = self.order.windows(self.shard, epoch)[w]
        ids, rows = self.order.rows_of(window)
        tables = [self.reader.table(g) for g in window.groups]
        x, y = self.reader.decoding.decode(tables, rows)  # each row lands in its place at once
        return ids, x, y

    def _needed(self, window: tuple[int, int], first_row: int) -> bool:
        """Whether a window starting at ``first_row`` of its epoch holds rows of a step
        before ``self.total`` (nothing is read ahead past the run's last step)."""
        if self.total is None:
            return True
        epoch, _, last = self.order.span(self.shard, self.total - 1)
        return window[0] < epoch or (window[0] == epoch and first_row < last)

    def _next_window(self, epoch: int, w: int) -> tuple[int, int]:
        if w + 1 < len(self.order.windows(self.shard, epoch)):
            return epoch, w + 1
        return epoch + 1, 0

    def _read_ahead(self, epoch: int, w: int, end: int) -> None:
        """Start reading the READ_AHEAD windows after window w (which ends at row ``end`` of
        its epoch) that a step before ``self.total`` needs."""
        for _ in range(READ_AHEAD):
            after = self._next_window(epoch, w)
            end = end if after[0] == epoch else 0  # the next window's first row
            if not self._needed(after, end):
                return
            self._window_data(*after)
            epoch, w = after
            end += self.order.windows(self.shard, epoch)[w].rows

    def take(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, x, y) this shard gives the global batch at ``step``."""
        epoch, first, last = self.order.span(self.shard, step)
        windows = self.order.windows(self.shard, epoch)
        parts = []
        w, start = self._scan_from(epoch, first)
        while w < len(windows):
            end = start + windows[w].rows
            if end > first:
                data = self._window_data(epoch, w)
                if self._ahead_of != (epoch, w):  # once a window: reading ahead is idempotent
                    self._ahead_of = (epoch, w)  # (asked before waiting: the first window's
                    self._read_ahead(epoch, w, end)  # wait would leave the other threads idle)
                ids, x, y = data.result()
                lo, hi = first - start if first > start else 0, min(last, end) - start
                parts.append((ids[lo:hi], x[lo:hi], y[lo:hi]))
            if end >= last:
                break
            start, w = end, w + 1
        self._scanned = (epoch, w, start)
        # Windows before this step's last are done with (kept in the order they were asked
        # for, which is the stream's).
        while self._loaded and next(iter(self._loaded)) < (epoch, w):
            del self._loaded[next(iter(self._loaded))]
        return joined(parts)

    def _scan_from(self, epoch: int, first: int) -> tuple[int, int]:
        """(window, its first row) to look for row ``first`` from: where the step before
        ended, as steps go forward (not every window of the epoch again, at every step)."""
        if self._scanned is not None:
            scanned_epoch, w, start = self._scanned
            if scanned_epoch == epoch and start <= first:
                return w, start
        return 0, 0


def joined(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    """(ids, x, y) of the parts one after the other; a single part as it is (a view of its
    window, not a copy: most steps lie in one window of one shard)."""
    if len(parts) == 1:
        return parts[0]
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
        return joined([c.take(step) for c in self.cursors])

    def steps(self, start: int, total: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        for cursor in self.cursors:
            cursor.total = total
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
        if one is None and given < self.count:  # no held-out rows of its own (data.eval_path
            x, y = self.reader.read(self.groups[0] if self.groups else 0)  # of few row groups)
            one = (x[:1], y[:1])
        for _ in range(self.count - given):  # a padding batch: a real row, weighing nothing
            yield one[0], one[1], 0.0
