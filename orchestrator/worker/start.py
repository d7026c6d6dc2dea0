"""Where every worker of an attempt starts, decided before the training function runs: the
frozen WorkerSpec each worker receives, and the checkpoint rank 0 chose (Start). No Ray and
no framework here: the collective is a protocol (orchestrator/worker/loop.py gives Ray's).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from orchestrator.checkpoint.cleanup import STAGING, remove_stale
from orchestrator.checkpoint.retry import with_retries
from orchestrator.checkpoint.store import (
    READING_BACKOFF,
    UNREACHABLE_ADVICE,
    CheckpointRef,
    CheckpointStore,
    CheckpointUnreachable,
    open_source,
)
from orchestrator.config.schema import CheckpointConfig, DataConfig
from orchestrator.errors import one_line
from orchestrator.ray_internals.knobs import NO_DEADLINE_PREEMPTION_S
from orchestrator.redaction import redact, redact_text
from orchestrator.storage.location import StorageSpec


@dataclass(frozen=True, repr=False)
class WorkerSpec:
    fn: str  # the training function, "module:function"
    config: dict  # what the function gets as cfg: {"trainer": {...}, "data": {...}}
    data: DataConfig
    checkpoint: CheckpointConfig
    run_storage: StorageSpec  # this run's checkpoint folder
    resume_source: StorageSpec | None  # resume=<uri>, used while the run has no checkpoint
    seed: int
    recorder: Any  # the RunRecorder actor handle
    preemption_check_s: float = 1.0  # how often the workers agree on preemption notices
    # how long to hold after a notice without deadline: past the one Ray Train gives it
    preemption_wait_s: float = NO_DEADLINE_PREEMPTION_S + 10.0
    eval_every_steps: int | None = None  # run.eval_every_steps
    stream: Any = None  # a StreamPlan where data=parquet is streamed (orchestrator/data/streaming.py)
    run_name: str = ""
    max_restarts: int = 0  # failure.max_restarts
    spare_after_s: float | None = None  # failure.spare_after_s; None in a sweep's trials
    # The command's folder: its workers on its node start there (Ray starts them in its own;
    # a service's job's processes in the folder of its first command)
    code_dir: str | None = None
    data_files: dict | None = None  # {file: SHA-256} of the data: every checkpoint keeps it
    node_agreement: bool = False  # the "agreement" hook (ray_internals/preemption_agreement.py)

    def __repr__(self) -> str:
        # Ray Train stringifies the train loop config (this spec) into the run state that the
        # dashboard's Train page shows: no secret of the config or the storage in it.
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "recorder"}
        shown["config"] = redact(self.config)
        return redact_text(f"WorkerSpec({shown!r})")


class Collective(Protocol):
    def broadcast(self, value: Any) -> Any: ...  # rank 0's value, on every rank

    # (the drain notice, or None; rank 0's proposal), the same on every rank. ``waited_s``, if
    # the collective has it: rank 0's, how long the other ranks waited for its last answers.
    def agree(self, proposal: Any) -> tuple[Any, Any]: ...


class ResumeSourceGone(RuntimeError):
    """resume=<uri> named a checkpoint the driver found, and a later attempt did not."""


@dataclass
class Start:
    """Where every worker of this attempt starts: the checkpoint rank 0 chose and verified."""

    attempt: str  # names this worker group's checkpoint parts
    staging: Path  # where this rank's snapshots are written
    step: int = 0
    store: CheckpointStore | None = None
    ref: CheckpointRef | None = None
    path: Path | None = None  # rank 0's verified local copy
    meta: dict = field(default_factory=dict)
    protect: set[int] = field(default_factory=set)  # never pruned: the run resumes from it


def choose_checkpoint(spec: WorkerSpec, cache: Path) -> tuple[dict, Path | None]:
    """Rank 0: the newest intact checkpoint of this run, else resume=<uri>'s. Corrupt ones are
    reported and skipped. Returns what the other ranks need to find it, and the local copy."""
    store = CheckpointStore(spec.run_storage)
    skipped: list[str] = []
    corrupt: list[CheckpointRef] = []
    found = store.newest_intact(cache, skipped, corrupt)
    remove_stale(store)  # failed writes of earlier attempts: nothing of the run writes now
    for reason in skipped:
        spec.recorder.warning.remote(reason)
    for ref in corrupt:  # written again when training reaches its step (never kept as committed)
        try:
            aside = store.set_aside(ref)
        except OSError as exc:
            spec.recorder.warning.remote(f"the corrupt checkpoint at step {ref.step} could not be "
                                         f"uncommitted ({one_line(exc)}): it stays as it is")
            continue
        spec.recorder.warning.remote(f"the corrupt checkpoint at step {ref.step} is uncommitted "
                                     f"(its manifest moved to {aside}): training writes it again "
                                     f"when it reaches step {ref.step}")
    source = False
    if found is None and spec.resume_source is not None:
        try:  # a store that blinks is retried, as the run's own checkpoints are
            opened = with_retries(f"reading {spec.resume_source.uri}",
                                  lambda: open_source(spec.resume_source), READING_BACKOFF)
        except OSError as exc:
            raise CheckpointUnreachable(
                f"resume={spec.resume_source.uri!r} could not be read ({one_line(exc)[:200]}): "
                f"{UNREACHABLE_ADVICE}") from exc
        if opened is None:  # the driver saw it: pruned or deleted since, never a silent step 0
            raise ResumeSourceGone(
                f"resume={spec.resume_source.uri!r}: no committed checkpoint there any more "
                "(pruned or deleted since the run started), and the run has none of its own")
        other, ref = opened
        found = (ref, other.fetch_loaded(ref, cache, lambda name: True)[0])
        source, store = True, other
    if skipped:  # retention goes by commit order (CheckpointStore.prune): its work is kept
        start = f"resumes from step {found[0].step}" if found else "starts at step 0"
        spec.recorder.warning.remote(
            f"the run {start}, older than the {len(skipped)} committed checkpoint(s) it could "
            "not read: retention keeps the checkpoints it writes now over those")
    if found is None:
        return {"step": 0}, None
    ref, path = found
    manifest = store.read_manifest(ref)
    meta = manifest.get("meta", {})
    spec.recorder.note.remote(f"resumed from {ref.uri} (step {ref.step})")
    if not source:  # its commit's report may have died with the node that committed it
        nbytes = sum(entry["bytes"] for entry in manifest.get("files", {}).values())
        spec.recorder.checkpoint_found.remote(ref.step, ref.uri, nbytes)
    return {"step": ref.step, "source_uri": store.spec.uri if source else None, "meta": meta}, path


def start_point(spec: WorkerSpec, rank: int, collective: Collective, workdir: Path) -> Start:
    """One broadcast: every rank starts from the checkpoint rank 0 chose."""
    choice, path = (choose_checkpoint(spec, workdir / "restore") if rank == 0 else (None, None))
    if rank == 0:
        choice["attempt"] = uuid.uuid4().hex[:10]
    choice = collective.broadcast(choice)
    attempt = choice["attempt"]
    store = CheckpointStore(spec.run_storage)
    staging = staging_root(store, attempt, rank, workdir)
    if not choice["step"]:
        return Start(attempt, staging)
    if choice.get("source_uri"):
        store = CheckpointStore(spec.resume_source.sibling(choice["source_uri"]))
    ref = store.ref(choice["step"])
    protect = set() if choice.get("source_uri") else {ref.step}
    return Start(attempt, staging, ref.step, store, ref, path, choice.get("meta", {}), protect)


def staging_root(store: CheckpointStore, attempt: str, rank: int, workdir: Path) -> Path:
    """A local store's snapshots are written next to it (storing them is then a rename);
    an object store's on this node's disk."""
    if store.is_local:
        return Path(store.root) / STAGING / f"{attempt}-rank_{rank:05d}"
    return workdir / "staging"
