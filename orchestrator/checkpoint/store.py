"""A checkpoint is a folder ``step_<n>`` of files plus ``manifest.json``, written last.

The manifest lists every file with its size and SHA-256. A folder without a manifest is an
unfinished write and is never taken as a checkpoint; a folder whose files disagree with the
manifest is corrupt and is skipped in favour of the next older one. Committed checkpoints
are never overwritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import pyarrow.fs as pafs

from orchestrator.checkpoint.retry import DEFAULT_BACKOFF, Backoff, with_retries
from orchestrator.storage import StorageSpec, join

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{9})$")


class CorruptCheckpoint(RuntimeError):
    pass


@dataclass(frozen=True)
class CheckpointRef:
    step: int
    uri: str  # as the user would write it (scheme kept for s3://)
    path: str  # inside the filesystem


@dataclass
class SavedCheckpoint:
    ref: CheckpointRef
    bytes: int
    save_s: float
    meta: dict = field(default_factory=dict)


def step_dir(step: int) -> str:
    return f"step_{step:09d}"


class CheckpointStore:
    """The committed checkpoints under one root URI (one run)."""

    def __init__(self, spec: StorageSpec):
        self.spec = spec
        self.fs, self.root = spec.filesystem()

    # -- reading -----------------------------------------------------------------------
    def committed(self) -> list[CheckpointRef]:
        """Committed checkpoints, oldest first."""
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except FileNotFoundError:
            return []
        refs = []
        for info in infos:
            match = _STEP_DIR.match(info.base_name)
            if info.type != pafs.FileType.Directory or not match:
                continue
            manifest = self.fs.get_file_info(join(info.path, MANIFEST))
            if manifest.type == pafs.FileType.File:
                step = int(match.group(1))
                refs.append(CheckpointRef(step, join(self.spec.uri, info.base_name), info.path))
        return sorted(refs, key=lambda r: r.step)

    def latest(self) -> CheckpointRef | None:
        refs = self.committed()
        return refs[-1] if refs else None

    def read_manifest(self, ref: CheckpointRef) -> dict:
        with self.fs.open_input_stream(join(ref.path, MANIFEST)) as f:
            return json.loads(f.read())

    def load(self, ref: CheckpointRef) -> tuple[dict[str, bytes], dict]:
        """The files of a checkpoint and its meta, checked against the manifest."""
        manifest = self.read_manifest(ref)
        files = {}
        for name, entry in manifest["files"].items():
            with self.fs.open_input_stream(join(ref.path, name)) as f:
                data = f.read()
            if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise CorruptCheckpoint(f"{ref.uri}/{name} does not match its manifest")
            files[name] = data
        return files, manifest.get("meta", {})

    def load_newest_intact(self, skipped: list[str] | None = None):
        """(ref, files, meta) of the newest checkpoint whose files match their manifest, or
        None. Corrupt ones are logged and described in ``skipped``."""
        for ref in reversed(self.committed()):
            try:
                files, meta = self.load(ref)
            except (CorruptCheckpoint, OSError, ValueError, KeyError) as exc:
                reason = f"checkpoint {ref.uri} is unreadable ({exc}); trying an older one"
                log.warning(reason)
                if skipped is not None:
                    skipped.append(reason)
                continue
            return ref, files, meta
        return None

    # -- writing -----------------------------------------------------------------------
    def save(self, step: int, files: Mapping[str, bytes], meta: dict | None = None,
             backoff: Backoff = DEFAULT_BACKOFF) -> SavedCheckpoint:
        """Upload the files one by one (each retried through outages), check the sizes the
        store reports, then write the manifest with sizes and SHA-256: the commit."""
        started = time.perf_counter()
        meta = meta or {}
        name = step_dir(step)
        path, uri = join(self.root, name), join(self.spec.uri, name)
        ref = CheckpointRef(step, uri, path)
        entries = {f: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()}
                   for f, d in files.items()}
        total = sum(e["bytes"] for e in entries.values())
        if self._is_committed(path):  # committed by an earlier attempt: never overwrite it
            return SavedCheckpoint(ref, total, 0.0, meta)
        with_retries(f"creating {uri}", lambda: self.fs.create_dir(path, recursive=True), backoff)
        for fname, data in files.items():
            with_retries(f"uploading {uri}/{fname}",
                         lambda f=fname, d=data: self._upload(join(path, f), d), backoff)
        for fname, entry in entries.items():
            size = with_retries(f"checking {uri}/{fname}",
                                lambda f=fname: self.fs.get_file_info(join(path, f)).size, backoff)
            if size != entry["bytes"]:
                raise CorruptCheckpoint(f"{uri}/{fname}: {size} bytes stored, {entry['bytes']} sent")
        manifest = {"step": step, "files": entries, "meta": meta, "committed_at": time.time()}
        data = json.dumps(manifest, indent=1).encode()
        with_retries(f"committing {uri}", lambda: self._write_atomically(join(path, MANIFEST), data),
                     backoff)
        return SavedCheckpoint(ref, total, time.perf_counter() - started, meta)

    def _upload(self, remote: str, data: bytes, chunk: int = 8 << 20) -> None:
        view = memoryview(data)
        with self.fs.open_output_stream(remote) as dst:
            for offset in range(0, len(view), chunk):
                dst.write(view[offset:offset + chunk])

    def _is_committed(self, path: str) -> bool:
        return self.fs.get_file_info(join(path, MANIFEST)).type == pafs.FileType.File

    def _write_atomically(self, path: str, data: bytes) -> None:
        if isinstance(self.fs, pafs.LocalFileSystem):
            tmp = path + ".tmp"
            with self.fs.open_output_stream(tmp) as f:
                f.write(data)
            self.fs.move(tmp, path)  # rename: readers see no manifest or a whole one
        else:
            with self.fs.open_output_stream(path) as f:  # an object PUT is atomic
                f.write(data)

    def prune(self, keep: int, protect: set[int] = frozenset()) -> list[int]:
        """Delete all but the newest ``keep`` committed checkpoints; never one in ``protect``."""
        if keep <= 0:
            return []
        refs = self.committed()
        doomed = [r for r in refs[:-keep] if r.step not in protect]
        for ref in doomed:
            # The manifest goes first, so a half-deleted folder is never seen as committed.
            self.fs.delete_file(join(ref.path, MANIFEST))
            self.fs.delete_dir(ref.path)
        return [r.step for r in doomed]


def open_source(spec: StorageSpec) -> tuple[CheckpointStore, CheckpointRef] | None:
    """``resume=<uri>``: a committed checkpoint folder, or a run folder (its newest one)."""
    fs, path = spec.filesystem()
    if fs.get_file_info(join(path, MANIFEST)).type == pafs.FileType.File:
        parent_uri, name = spec.uri.rstrip("/").rsplit("/", 1)
        match = _STEP_DIR.match(name)
        if not match:
            return None
        store = CheckpointStore(StorageSpec(parent_uri, spec.endpoint, spec.region))
        ref = next((r for r in store.committed() if r.step == int(match.group(1))), None)
        return (store, ref) if ref else None
    store = CheckpointStore(spec)
    ref = store.latest()
    return (store, ref) if ref else None
