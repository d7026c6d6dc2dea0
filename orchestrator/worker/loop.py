"""What runs in every Ray Train worker: agree where to start, run the training function with
its WorkerContext, record what happened. No framework.

WorkerSpec and Start (orchestrator/worker/start.py) say what every worker receives and where
it starts; the WorkerContext (orchestrator/worker_api.py) is the live per-worker state the
function talks to, and its WorkerLifecycle the part of it only this module uses.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import ray
import ray.train
import ray.train.collective

from orchestrator.driver.failure_policy import WorkerError
from orchestrator.errors import cause_of, one_line
from orchestrator.ray_internals import preemption_agreement
from orchestrator.storage.probe import check_worker_node
from orchestrator.worker.spare import ask_for_spare_later
from orchestrator.worker.start import WorkerSpec, start_point
from orchestrator.worker.training_function import import_function
from orchestrator.worker.workdir import Workdir
from orchestrator.worker_api import WorkerContext, WorkerLifecycle

PREEMPTION_GRACE_S = 5.0  # held past a notice's deadline before concluding the node stays


class RayCollective:
    def __init__(self, rank: int, node_agreement: bool = False):
        self.rank = rank
        # ray_internals/preemption_agreement.py: one call per node (rank 0's alone on one node)
        self.node = preemption_agreement.for_this_worker(rank) if node_agreement else None

    @property
    def waited_s(self) -> float:
        """Rank 0: how long the other nodes waited for its answer at its last checks."""
        return self.node.waited_s if self.node is not None else 0.0

    def broadcast(self, value: Any) -> Any:
        return ray.train.collective.broadcast_from_rank_zero(value)

    def agree(self, proposal: Any) -> tuple[Any, Any]:
        if self.node is not None:
            return self.node.agree(proposal)
        return ray.train.get_preemption_info(), self.broadcast(proposal)

    def close(self) -> None:
        if self.node is not None:
            self.node.close()


def enter_code_dir(folder: str) -> None:
    """Where a plain command's workers on its node would be: in the command's folder, with it
    first on sys.path (its own modules: trainer.model._target_=mypkg.Net)."""
    if not os.path.isdir(folder):  # another node's disk
        return
    os.chdir(folder)
    if sys.path[:1] != [folder]:
        sys.path.insert(0, folder)


def train_loop_per_worker(config: dict) -> None:
    """The function Ray Train runs on every worker."""
    spec: WorkerSpec = config["spec"]
    if spec.code_dir:
        enter_code_dir(spec.code_dir)
    train = ray.train.get_context()
    rank = train.get_world_rank()
    spec.recorder.worker_started.remote(rank, os.getpid(), ray.get_runtime_context().get_node_id())
    if ray.get(spec.recorder.permanent_error.remote()):
        return  # a failure repeated: the driver reports it; restarting again would not help
    workdir = Workdir(rank)  # removed at the end; a killed worker's, by the next one
    life: WorkerLifecycle | None = None
    collective: RayCollective | None = None
    spare = ask_for_spare_later(spec.spare_after_s, spec.recorder, says=rank == 0)  # worker/spare.py
    try:  # an exception from the training code is recorded, then re-raised
        # Shared storage (orchestrator/storage/probe.py): this node must see the run's folder
        # as the driver does (a node that joined after the driver's check fails here, clearly).
        check_worker_node(config.get("storage_marker"))
        fn = import_function(spec.fn)
        collective = RayCollective(rank, spec.node_agreement)
        start = start_point(spec, rank, collective, workdir.path)
        devices = [int(g) for g in ray.get_gpu_ids()]
        ctx = WorkerContext(spec, rank, train.get_local_rank(), train.get_world_size(), devices,
                            start, collective, workdir.path, train.get_node_rank(),
                            train.get_local_world_size())
        life = WorkerLifecycle(ctx)
        if spec.node_agreement and collective.node is None and rank == 0:  # a Ray that moved it
            ctx.warn("preemption checks take Ray's public calls (two barriers of one call per "
                     "rank), not one call per node: this Ray's worker context lacks what that "
                     "reads (ray_internals/preemption_agreement.py)")
        result = fn(ctx, copy.deepcopy(spec.config))
        metrics = final_metrics(result, ctx.warn if ctx.rank == 0 else lambda _: None)
        life.close()  # every upload done: the final checkpoint is committed, or it is said why
        missing = life.last_checkpoint_missing()
        if missing:
            raise CheckpointNotCommitted(missing, after_notice=life.notice is not None)
    except Exception as exc:
        step = life.step if life is not None else 0
        cause = cause_of(exc)
        error = WorkerError(rank, step, type(cause).__name__, one_line(cause)[:300],
                            getattr(cause, "details", None) or traceback.format_exc(),
                            pid=os.getpid(), retry=getattr(cause, "retry", True) is not False)
        ray.get(spec.recorder.worker_error.remote(error))
        raise
    finally:
        if spare is not None:
            spare.cancel()
        if life is not None:
            life.close()
            shutil.rmtree(life.staging, ignore_errors=True)
        if collective is not None:
            collective.close()
        workdir.remove()
    if ctx.should_preempt():
        hold_until_taken(spec, life)
    if rank == 0:
        life.announce()
        ray.get(spec.recorder.worker_finished.remote(life.step, metrics, time.time()))


class CheckpointNotCommitted(RuntimeError):
    """The run's newest checkpoint was never committed: it cannot say it succeeded. At the
    run's end it is not retried (a restart would train the lost steps again only to meet the
    same store; the same command resumes from the newest committed checkpoint); after a
    preemption notice it is (the run goes on elsewhere, from an older checkpoint)."""

    def __init__(self, message: str, after_notice: bool = False):
        super().__init__(message)
        self.retry = after_notice


class ResultNotMetrics(TypeError):
    """The function returned something other than None or a dict: after training, and the
    same again after a restart."""

    retry = False


def final_metrics(result: Any, warn: Callable[[str], None]) -> dict[str, float]:
    """The function's final metrics: its dict's numbers; a value that is not one (a path, a
    nested dict) is left out with a warning, not a failure after the training is done."""
    if result is None:
        return {}
    if not isinstance(result, Mapping):
        raise ResultNotMetrics(f"the training function returned {type(result).__name__}: return "
                               "None or a dict of final metrics")
    metrics = {}
    for key, value in result.items():
        try:
            metrics[str(key)] = float(value)
        except (TypeError, ValueError):
            warn(f"the training function's result[{str(key)!r}] = {str(value)[:60]!r} is not a "
                 "number: left out of the run's metrics")
    return metrics


def hold_until_taken(spec: WorkerSpec, life: WorkerLifecycle) -> None:
    """After a preemption notice the function saved and returned, and the checkpoint is
    committed: hold still until the node goes away, so that no step is computed that the
    restart would compute again. If it stays past the deadline, restart from there."""
    info = life.notice
    deadline = info.deadline_ms / 1000 if info.deadline_ms else None
    until = deadline + PREEMPTION_GRACE_S if deadline else time.time() + spec.preemption_wait_s
    while time.time() < until:
        time.sleep(0.5)
    raise RuntimeError(f"the preemption notice at step {life.step} passed its deadline and this "
                       "node is still here: restarting from the checkpoint taken at the notice")
