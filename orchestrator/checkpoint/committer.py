"""Checkpoints without stalling training: the step waits only for the local snapshot.

The trainer's save() already produced the checkpoint's bytes in memory: that is the
snapshot. snapshot() hands them to a background thread, which hashes and uploads them,
retrying through outages, and commits by writing the manifest last. With
asynchronous=False the same work happens inline, on the step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from orchestrator.checkpoint.retry import DEFAULT_BACKOFF, Backoff
from orchestrator.checkpoint.store import CheckpointStore, SavedCheckpoint

log = logging.getLogger("orchestrator.checkpoint")


@dataclass
class Snapshot:
    step: int
    files: Mapping[str, bytes]
    meta: dict
    save_s: float = 0.0


@dataclass
class Committed:
    saved: SavedCheckpoint
    save_s: float  # the time the training step was blocked to take the snapshot
    upload_s: float


class Committer:
    # Snapshots waiting for upload (each holds a checkpoint in memory); one more waits.
    MAX_QUEUED = 2

    def __init__(self, store: CheckpointStore, asynchronous: bool = True,
                 on_commit: Callable[[Committed], None] | None = None,
                 on_failure: Callable[[int, Exception], None] | None = None,
                 backoff: Backoff = DEFAULT_BACKOFF):
        self.store = store
        self.asynchronous = asynchronous
        self.on_commit = on_commit or (lambda c: None)
        self.on_failure = on_failure or (lambda step, exc: None)
        self.backoff = backoff
        self._queue: queue.Queue[Snapshot | None] = queue.Queue(maxsize=self.MAX_QUEUED)
        self._thread: threading.Thread | None = None
        self.committed_steps: list[int] = []

    def snapshot(self, step: int, files: Mapping[str, bytes], meta: dict,
                 serialize_s: float = 0.0) -> float:
        """Hand the files over for commit; return the seconds the step was blocked."""
        started = time.perf_counter()
        snap = Snapshot(step, files, meta)
        if self.asynchronous:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="checkpoint-upload",
                                                daemon=True)
                self._thread.start()
            snap.save_s = serialize_s + time.perf_counter() - started
            self._queue.put(snap)  # blocks only if uploads fall MAX_QUEUED behind
        else:
            snap.save_s = serialize_s
            self._commit(snap)
        return serialize_s + time.perf_counter() - started

    def flush(self) -> None:
        """Wait until every snapshot handed over so far is committed (or given up)."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        self.flush()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            snap = self._queue.get()
            try:
                if snap is None:
                    return
                self._commit(snap)
            finally:
                self._queue.task_done()

    def _commit(self, snap: Snapshot) -> None:
        started = time.perf_counter()
        try:
            saved = self.store.save(snap.step, snap.files, snap.meta, self.backoff)
        except Exception as exc:  # the run goes on; the next checkpoint tries again
            log.error("checkpoint at step %d was not committed: %s", snap.step,
                      str(exc).splitlines()[0][:300])
            self.on_failure(snap.step, exc)
            return
        self.committed_steps.append(snap.step)
        self.on_commit(Committed(saved, snap.save_s, time.perf_counter() - started))
