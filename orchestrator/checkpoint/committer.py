"""Checkpoints without stalling training: the step waits only for a local snapshot.

snapshot() writes the trainer's files to a local staging folder (hashing them on the way)
and returns; a background thread uploads them to the store, retrying through outages, and
commits by writing the manifest last. With asynchronous=False the upload happens inline.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from orchestrator.checkpoint.retry import DEFAULT_BACKOFF, Backoff
from orchestrator.checkpoint.store import CheckpointStore, SavedCheckpoint

log = logging.getLogger("orchestrator.checkpoint")


@dataclass
class Snapshot:
    step: int
    folder: Path
    entries: dict[str, dict]  # file name -> {"bytes", "sha256"}
    meta: dict
    save_s: float


@dataclass
class Committed:
    saved: SavedCheckpoint
    save_s: float  # the time the training step was blocked for the snapshot
    upload_s: float


class Committer:
    MAX_QUEUED = 2  # snapshots waiting for upload; beyond that the next snapshot waits

    def __init__(self, store: CheckpointStore, asynchronous: bool = True,
                 on_commit: Callable[[Committed], None] | None = None,
                 on_failure: Callable[[int, Exception], None] | None = None,
                 backoff: Backoff = DEFAULT_BACKOFF):
        self.store = store
        self.asynchronous = asynchronous
        self.on_commit = on_commit or (lambda c: None)
        self.on_failure = on_failure or (lambda step, exc: None)
        self.backoff = backoff
        self.staging = Path(tempfile.mkdtemp(prefix="orchestrator-staging-"))
        self._queue: queue.Queue[Snapshot | None] = queue.Queue(maxsize=self.MAX_QUEUED)
        self._thread: threading.Thread | None = None
        self.committed_steps: list[int] = []

    def snapshot(self, step: int, files: Mapping[str, bytes], meta: dict, serialize_s: float = 0.0) -> float:
        """Stage the files locally and hand them to the uploader; return seconds blocked."""
        started = time.perf_counter()
        folder = self.staging / f"step_{step:09d}"
        folder.mkdir(parents=True, exist_ok=True)
        entries = {}
        for name, data in files.items():
            (folder / name).write_bytes(data)
            entries[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        snap = Snapshot(step, folder, entries, meta, 0.0)
        if self.asynchronous:
            self._ensure_thread()
            self._queue.put(snap)  # blocks only if uploads fall MAX_QUEUED behind
            snap.save_s = serialize_s + time.perf_counter() - started
        else:
            snap.save_s = serialize_s + time.perf_counter() - started
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
        shutil.rmtree(self.staging, ignore_errors=True)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="checkpoint-upload", daemon=True)
            self._thread.start()

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
            saved = self.store.commit_folder(snap.step, snap.folder, snap.entries, snap.meta,
                                             self.backoff)
        except Exception as exc:  # the run goes on; the next checkpoint tries again
            log.error("checkpoint at step %d was not committed: %s", snap.step,
                      str(exc).splitlines()[0][:300])
            self.on_failure(snap.step, exc)
            return
        finally:
            shutil.rmtree(snap.folder, ignore_errors=True)
        self.committed_steps.append(snap.step)
        self.on_commit(Committed(saved, snap.save_s, time.perf_counter() - started))
