"""Checkpoints without stalling training: the step waits only for the local snapshot.

Every rank has a Committer. The snapshot is the folder the rank's ``write(dir)`` filled (or
is filling, when write returned a future: the committer waits for it first); the
committer takes it over, and a background thread stores it as this rank's part of the
checkpoint (hashing, uploading, retrying through outages). On rank 0 the same thread then
waits for every other rank's part and commits by writing the manifest last. With
asynchronous=False the same work happens inline, on the step.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.checkpoint.retry import DEFAULT_BACKOFF, Backoff
from orchestrator.checkpoint.store import CheckpointStore, SavedCheckpoint
from orchestrator.errors import one_line

log = logging.getLogger("orchestrator.checkpoint")


@dataclass
class Snapshot:
    step: int
    folder: Path  # this rank's files; the committer deletes the folder when it is done
    meta: dict
    save_s: float = 0.0
    pending: Any = None  # a future that finishes writing the folder, or None


@dataclass
class Committed:
    saved: SavedCheckpoint
    save_s: float  # the longest time a rank's step was blocked taking its snapshot
    upload_s: float  # from rank 0's files being complete to the commit
    write_s: float = 0.0  # the longest a rank's upload waited for its files (a pending write)


class CheckpointDropped(RuntimeError):
    """Uploads fell behind: a newer snapshot took this one's place in the queue."""


class Committer:
    # Snapshots waiting behind the one being uploaded (each holds a checkpoint on local
    # disk). A save waits at most MAX_WAIT_S for room; then the oldest waiting one is dropped
    # instead, so that an outage never stalls training and the newest checkpoint goes next.
    MAX_QUEUED = 2
    MAX_WAIT_S = 10.0

    def __init__(self, store: CheckpointStore, rank: int = 0, world_size: int = 1,
                 attempt: str = "single", asynchronous: bool = True,
                 on_commit: Callable[[Committed], None] | None = None,
                 on_failure: Callable[[int, Exception], None] | None = None,
                 backoff: Backoff = DEFAULT_BACKOFF):
        self.store = store
        self.rank, self.world_size, self.attempt = rank, world_size, attempt
        self.asynchronous = asynchronous
        self.on_commit = on_commit or (lambda c: None)
        self.on_failure = on_failure or (lambda step, exc: None)
        self.backoff = backoff
        self._waiting: deque[Snapshot] = deque()
        self._dropped: list[tuple[int, str]] = []  # (step, why): rank 0 is told by the thread
        self._busy = False  # the thread holds a snapshot
        self._stopping = False
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self.committed_steps: list[int] = []  # rank 0: committed; others: part stored

    def snapshot(self, step: int, folder: Path, meta: dict, save_s: float = 0.0,
                 pending: Any = None) -> float:
        """Hand this rank's files over (``pending``: a future that finishes writing them);
        return the seconds the step was blocked in here."""
        started = time.perf_counter()
        snap = Snapshot(step, Path(folder), meta, save_s, pending)
        if not self.asynchronous:
            self._store(snap)
            return time.perf_counter() - started
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="checkpoint-upload",
                                            daemon=True)
            self._thread.start()
        with self._cv:
            self._cv.wait_for(lambda: len(self._waiting) < self.MAX_QUEUED, self.MAX_WAIT_S)
            dropped = self._waiting.popleft() if len(self._waiting) >= self.MAX_QUEUED else None
            self._waiting.append(snap)
            if dropped is not None:
                why = (f"uploads fell behind: the checkpoint at step {snap.step} took its place "
                       f"after {self.MAX_WAIT_S:.0f} s (a save never stalls training longer)")
                self._dropped.append((dropped.step, why))
            self._cv.notify_all()
        if dropped is not None:
            shutil.rmtree(dropped.folder, ignore_errors=True)
            log.warning("checkpoint at step %d dropped: %s", dropped.step, why)
            self.on_failure(dropped.step, CheckpointDropped(why))
        return time.perf_counter() - started

    def flush(self) -> None:
        """Wait until every snapshot handed over so far is stored (rank 0: committed) or
        dropped."""
        with self._cv:
            self._cv.wait_for(lambda: not (self._waiting or self._busy or self._dropped))

    def close(self) -> None:
        if self._thread is None:
            return
        self.flush()
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join()
        self._thread = None
        self._stopping = False

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._waiting or self._dropped or self._stopping)
                if not (self._waiting or self._dropped):
                    return
                dropped, self._dropped = self._dropped, []
                snap = self._waiting.popleft() if self._waiting else None
                self._busy = True
            try:
                for step, why in dropped if self.rank != 0 else ():
                    try:  # rank 0 must not wait for parts that will not come (best effort)
                        self.store.give_up_part(step, self.rank, self.attempt, why)
                    except Exception as exc:  # nothing may end this thread: flush waits on it
                        log.warning("telling rank 0 about step %d: %s", step, one_line(exc))
                if snap is not None:
                    self._store(snap)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _store(self, snap: Snapshot) -> None:
        started, write_s = time.perf_counter(), 0.0
        try:
            if snap.pending is not None:
                snap.pending.result()  # the files are complete (it raises if writing failed)
                write_s = time.perf_counter() - started
                started = time.perf_counter()
            budget = self.backoff.budget()  # one deadline for the whole checkpoint
            if self.store.is_committed(snap.step, budget):  # an earlier attempt committed it
                return
            self.store.upload_part(snap.step, self.rank, self.attempt, snap.folder, budget,
                                   note={"save_s": round(snap.save_s, 4), "write_s": round(write_s, 4)})
            saved = None
            if self.rank == 0:
                parts = self.store.wait_for_parts(snap.step, self.attempt, self.world_size, budget)
                saved = self.store.commit(snap.step, parts, snap.meta, budget)
                save_s = max(p.get("save_s", 0.0) for p in parts.values())
                write_s = max(p.get("write_s", 0.0) for p in parts.values())
        except BaseException as exc:  # the run goes on; the next checkpoint tries again
            # (a write's future may raise a BaseException: DCP's CheckpointException is one,
            # and this thread ending would hold every later flush forever)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            log.error("checkpoint at step %d was not committed: %s", snap.step,
                      one_line(exc)[:300])
            if self.rank != 0:
                self.store.give_up_part(snap.step, self.rank, self.attempt, one_line(exc))
            self.on_failure(snap.step, exc)
            return
        finally:
            shutil.rmtree(snap.folder, ignore_errors=True)
        self.committed_steps.append(snap.step)
        if saved is not None:
            try:  # bookkeeping (the record, retention) must never end the upload thread
                self.on_commit(Committed(saved, save_s, time.perf_counter() - started, write_s))
            except Exception as exc:
                log.error("after committing step %d: %s", snap.step, one_line(exc)[:300])
