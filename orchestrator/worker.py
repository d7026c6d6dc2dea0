"""What runs in every Ray Train worker: agree where to start, run the training function with
its WorkerContext, record what happened. No framework.

WorkerSpec is the frozen description every worker receives; the WorkerContext
(orchestrator/worker_api.py) is the live per-worker state the function talks to.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import time
import traceback
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import ray
import ray.train
import ray.train.collective

from orchestrator.checkpoint.store import CheckpointRef, CheckpointStore, open_source
from orchestrator.config.schema import CheckpointConfig, DataConfig
from orchestrator.errors import cause_of, one_line
from orchestrator.failure_policy import WorkerError
from orchestrator.storage import StorageSpec
from orchestrator.storage_probe import check_worker_node
from orchestrator.training_function import import_function
from orchestrator.worker_api import WorkerContext

PREEMPTION_GRACE_S = 5.0  # held past a notice's deadline before concluding the node stays


@dataclass(frozen=True)
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
    preemption_wait_s: float = 30.0  # how long to wait for a notice without deadline
    eval_every_steps: int | None = None  # run.eval_every_steps
    stream: Any = None  # a StreamPlan where data=parquet is streamed (orchestrator/data/streaming.py)
    run_name: str = ""
    max_restarts: int = 0  # failure.max_restarts


class Collective(Protocol):
    def broadcast(self, value: Any) -> Any: ...  # rank 0's value, on every rank

    def preemption_info(self) -> Any: ...  # a barrier; the drain notice, or None


class RayCollective:
    def broadcast(self, value: Any) -> Any:
        return ray.train.collective.broadcast_from_rank_zero(value)

    def preemption_info(self) -> Any:
        return ray.train.get_preemption_info()


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
    found = store.newest_intact(cache, skipped)
    for reason in skipped:
        spec.recorder.warning.remote(reason)
    source = False
    if found is None and spec.resume_source is not None:
        opened = open_source(spec.resume_source)
        if opened is not None:
            other, ref = opened
            found, source = (ref, other.fetch(ref, cache)), True
            store = other
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
        return Path(store.root) / ".staging" / f"{attempt}-rank_{rank:05d}"
    return workdir / "staging"


def train_loop_per_worker(config: dict) -> None:
    """The function Ray Train runs on every worker."""
    spec: WorkerSpec = config["spec"]
    train = ray.train.get_context()
    rank = train.get_world_rank()
    spec.recorder.worker_started.remote(rank, os.getpid(), ray.get_runtime_context().get_node_id())
    if ray.get(spec.recorder.permanent_error.remote()):
        return  # a failure repeated: the driver reports it; restarting again would not help
    workdir = Path(tempfile.mkdtemp(prefix=f"orchestrator-rank{rank}-"))
    ctx: WorkerContext | None = None
    try:  # an exception from the training code is recorded, then re-raised
        # Shared storage (orchestrator/storage_probe.py): this node must see the run's folder
        # as the driver does (a node that joined after the driver's check fails here, clearly).
        check_worker_node(config.get("storage_marker"))
        fn = import_function(spec.fn)
        start = start_point(spec, rank, RayCollective(), workdir)
        devices = [int(g) for g in ray.get_gpu_ids()]
        ctx = WorkerContext(spec, rank, train.get_local_rank(), train.get_world_size(), devices,
                            start, RayCollective(), workdir, train.get_node_rank(),
                            train.get_local_world_size())
        result = fn(ctx, copy.deepcopy(spec.config))
        metrics = final_metrics(result)
        ctx._close()  # every upload done: the final checkpoint is committed, or it is said why
        missing = ctx._last_checkpoint_missing()
        if missing:
            raise CheckpointNotCommitted(missing)
    except Exception as exc:
        step = ctx._step if ctx is not None else 0
        cause = cause_of(exc)
        error = WorkerError(rank, step, type(cause).__name__, one_line(cause)[:300],
                            getattr(cause, "details", None) or traceback.format_exc(),
                            pid=os.getpid())
        ray.get(spec.recorder.worker_error.remote(error))
        raise
    finally:
        if ctx is not None:
            ctx._close()
        shutil.rmtree(workdir, ignore_errors=True)
        if ctx is not None and ctx._start.staging.exists():
            shutil.rmtree(ctx._start.staging, ignore_errors=True)
    if ctx.should_preempt():
        hold_until_taken(spec, ctx)
    if rank == 0:
        ctx._announce()
        ray.get(spec.recorder.worker_finished.remote(ctx._step, metrics, time.time()))


class CheckpointNotCommitted(RuntimeError):
    """The run's newest checkpoint was never committed: it cannot say it succeeded."""


def final_metrics(result: Any) -> dict[str, float]:
    if result is None:
        return {}
    if not isinstance(result, Mapping):
        raise TypeError(f"the training function returned {type(result).__name__}: return None "
                        "or a dict of final metrics")
    return {str(k): float(v) for k, v in result.items()}


def hold_until_taken(spec: WorkerSpec, ctx: WorkerContext) -> None:
    """After a preemption notice the function saved and returned, and the checkpoint is
    committed: hold still until the node goes away, so that no step is computed that the
    restart would compute again. If it stays past the deadline, restart from there."""
    info = ctx._notice
    deadline = info.deadline_ms / 1000 if info.deadline_ms else None
    until = deadline + PREEMPTION_GRACE_S if deadline else time.time() + spec.preemption_wait_s
    while time.time() < until:
        time.sleep(0.5)
    raise RuntimeError(f"the preemption notice at step {ctx._step} passed its deadline and this "
                       "node is still here: restarting from the checkpoint taken at the notice")
