"""What failed writes leave in a run's storage, removed when a worker group starts and when the
run has succeeded (nothing of the run writes then): the staging folders of ranks that were
killed (a local store's snapshots, FSDP's full shards among them), the step folders that were
never committed, older than the newest commit, and an object store's multipart uploads that a
killed writer left unfinished (storage/multipart.py). A folder holding a corrupt checkpoint's
set-aside manifest is kept for a look."""

from __future__ import annotations

import errno
import logging
import os

import pyarrow.fs as pafs

from orchestrator.checkpoint.store import CheckpointStore, step_of
from orchestrator.storage.location import join
from orchestrator.storage.multipart import abort_unfinished_uploads

log = logging.getLogger(__name__)

STAGING = ".staging"


def remove_stale(store: CheckpointStore) -> list[str]:
    """Remove what earlier attempts' failed writes left; return the paths (and the unfinished
    uploads' keys) removed. Errors are warnings: cleaning never stops a run (a throttled
    listing after a run succeeded, or at a worker group's start)."""
    removed: list[str] = []
    for clean in (abort_unfinished_uploads, lambda spec: remove_failed_writes(store)):
        try:  # one failing does not keep the other from its part
            removed += clean(store.spec)
        except OSError as exc:
            log.warning("cleaning %s: %s", store.spec.uri, exc)
    if removed:
        log.info("removed %d leftovers of failed writes: %s", len(removed), ", ".join(removed))
    return removed


def remove_failed_writes(store: CheckpointStore) -> list[str]:
    removed: list[str] = []
    infos = store.fs.get_file_info(pafs.FileSelector(store.root, allow_not_found=True))
    steps = {step_of(i.base_name): i for i in infos if i.type == pafs.FileType.Directory}
    steps.pop(None, None)
    committed = {s for s in steps if store.is_committed(s)}
    newest = max(committed, default=None)
    stale = [i.path for s, i in steps.items()
             if newest is not None and s < newest and s not in committed and not set_aside(store, i.path)]
    if store.is_local:
        stale += [i.path for i in store.fs.get_file_info(
            pafs.FileSelector(join(store.root, STAGING), allow_not_found=True))]
    for path in stale:
        try:
            if store.fs.get_file_info(path).type == pafs.FileType.Directory:
                store.fs.delete_dir(path)
            else:
                store.fs.delete_file(path)
            removed.append(path)
        except OSError as exc:
            if exc.errno == errno.ENOENT:  # an object store's name for a folder it emptied
                continue  # (SeaweedFS lists it after its last object went): nothing is there
            log.warning("cleaning %s: %s", path, exc)
    if store.is_local:
        try:  # the staging folder itself, once no rank has one in it
            os.rmdir(join(store.root, STAGING))
        except OSError:
            pass
    return removed


def set_aside(store: CheckpointStore, folder: str) -> bool:
    """Whether a step folder holds a corrupt checkpoint's set-aside manifest."""
    infos = store.fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True))
    return any(i.base_name.startswith("manifest.corrupt-") for i in infos)
