"""What runs in every Ray Train worker: restore, train, checkpoint, report. No framework.

WorkerSpec is the frozen description every worker receives; WorkerSession is the live
per-worker state the trainer talks to.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

import ray
import ray.train
import ray.train.collective
from hydra.utils import get_class

from orchestrator.checkpoint.committer import Committed, Committer
from orchestrator.checkpoint.policy import CheckpointPolicy
from orchestrator.checkpoint.retry import Backoff
from orchestrator.checkpoint.store import CheckpointStore, open_source
from orchestrator.config.schema import CheckpointConfig, DataConfig
from orchestrator.data.datasets import load_dataset
from orchestrator.data.order import DataOrder
from orchestrator.failure_policy import WorkerError
from orchestrator.preemption_checks import PreemptionChecks
from orchestrator.storage import StorageSpec

PROGRESS_EVERY_S = 0.25  # how often rank 0 tells the run recorder how far it got


@dataclass(frozen=True)
class WorkerSpec:
    trainer: dict[str, Any]  # the trainer config, _target_ included
    data: DataConfig
    checkpoint: CheckpointConfig
    run_storage: StorageSpec  # this run's checkpoint folder
    resume_source: StorageSpec | None  # resume=<uri>, used while the run has no checkpoint
    seed: int
    recorder: Any  # the RunRecorder actor handle
    preemption_check_s: float = 1.0  # how often the workers agree on preemption notices
    preemption_wait_s: float = 30.0  # how long to wait for a notice without deadline
    eval_every_steps: int | None = None  # rank 0 evaluates on the test split this often


class WorkerSession:
    def __init__(self, spec: WorkerSpec, rank: int, world_size: int):
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.seed = spec.seed
        self.store = CheckpointStore(spec.run_storage)
        self.policy = CheckpointPolicy(spec.checkpoint.every_steps, spec.checkpoint.every_seconds)
        self.trainer = None
        self.total_steps = 0
        self.step = 0
        self._last_progress = 0.0
        self._unsent_samples = 0
        self._unsent_points: list[tuple[int, dict[str, float]]] = []  # every step's metrics
        self._protect: set[int] = set()  # the checkpoint this attempt resumed from
        self._last_saved = -1
        self.checks = PreemptionChecks(spec.preemption_check_s, 0, time.monotonic())
        self.committer = Committer(self.store, spec.checkpoint.async_upload,
                                   on_commit=self._committed, on_failure=self._not_committed,
                                   backoff=Backoff(deadline_s=spec.checkpoint.upload_retry_s))

    @property
    def saves(self) -> bool:
        return self.rank == 0 or bool(self.trainer and self.trainer.saves_on_all_ranks)

    def data_order(self, num_rows: int, global_batch: int) -> DataOrder:
        return DataOrder(self.seed, num_rows, global_batch)

    # -- restore -----------------------------------------------------------------------
    def restore(self, trainer) -> int:
        """Load the newest intact checkpoint of this run (else resume=<uri>); return its step."""
        skipped: list[str] = []
        found = self.store.load_newest_intact(skipped)
        if self.rank == 0:
            for reason in skipped:
                self.spec.recorder.warning.remote(reason)
        if found is None and self.spec.resume_source is not None:
            source = open_source(self.spec.resume_source)
            if source is not None:
                store, ref = source
                files, meta = store.load(ref)
                found = (ref, files, meta)
        if found is None:
            return 0
        ref, files, _meta = found
        trainer.load(files)
        self._protect = {ref.step}
        if self.rank == 0:
            self.spec.recorder.note.remote(f"resumed from {ref.uri} (step {ref.step})")
        return ref.step

    def begin(self, start: int) -> None:
        """Training starts (again) at `start`: the step count and clocks start there."""
        self.step = start
        self.checks = PreemptionChecks(self.spec.preemption_check_s, start, time.monotonic())

    # -- the loop's callback -------------------------------------------------------------
    def step_done(self, step: int, metrics: dict[str, float], samples: int) -> None:
        """Called by the trainer after each finished step (1-based count of steps done)."""
        self.step = step
        now = time.monotonic()
        final = step >= self.total_steps
        if self.rank == 0:
            self._unsent_samples += samples
            self._unsent_points.append((step, dict(metrics)))
        if self.policy.should_save(step, now) or final:
            self.checkpoint(step)
        # Apart from the save decision (every_seconds reads each rank's own clock): this is a
        # barrier, and every rank must reach it at the same steps.
        if not final and self.checks.due(step):
            self.check_preemption(step)
        if self.rank == 0:
            every = self.spec.eval_every_steps
            if every and not final and step % every == 0:
                self.spec.recorder.evaluated.remote(step, self.trainer.evaluate())
            first = self._last_progress == 0.0
            if first or final or now - self._last_progress >= PROGRESS_EVERY_S:
                self.report_progress()

    def report_progress(self) -> None:
        """Send rank 0's steps since the last report (each step's metrics: the curves)."""
        if not self._unsent_points:
            return
        step, metrics = self._unsent_points[-1]
        self.spec.recorder.progress.remote(step, self._unsent_samples, metrics, time.time(),
                                           self._unsent_points)
        self._unsent_samples = 0
        self._unsent_points = []
        self._last_progress = time.monotonic()

    def checkpoint(self, step: int) -> None:
        self._last_saved = step  # on every rank, so that all agree on what was saved
        if self.rank == 0:
            # Reported before the commit event (one caller's actor calls arrive in order): a
            # restart from this checkpoint never leaves unreported steps behind it.
            self.report_progress()
        if not self.saves:
            return
        started = time.perf_counter()
        files = self.trainer.save()
        if self.rank != 0:
            return  # multi-writer trainers (MWMS) write through rank 0's copy
        meta = {"step": step, "world_size": self.world_size, "seed": self.seed}
        self.committer.snapshot(step, files, meta, serialize_s=time.perf_counter() - started)
        self.policy.saved(step, time.monotonic())

    def check_preemption(self, step: int) -> None:
        """A barrier across workers (they all reach it at the same steps): on a notice, save
        at this step boundary, wait for the upload, then hold still until the deadline so no
        step is computed that the restart would have to compute again."""
        info = ray.train.get_preemption_info()
        proposal = self.checks.propose(step, time.monotonic()) if self.rank == 0 else None
        self.checks.agreed(step, ray.train.collective.broadcast_from_rank_zero(proposal),
                           time.monotonic())
        if info is None:
            return
        deadline = info.deadline_ms / 1000 if info.deadline_ms else None
        left = (deadline - time.time()) if deadline else None
        if self.rank == 0:  # the recorder tells the user (the driver prints its notices)
            self.spec.recorder.preemption_notice.remote(step, left, info.preempted_node_ids,
                                                        time.time())
        if self._last_saved != step:
            self.checkpoint(step)
        self.committer.flush()
        until = deadline + 5.0 if deadline else time.time() + self.spec.preemption_wait_s
        while time.time() < until:  # the drain ends this process; if not, training goes on
            time.sleep(0.5)

    def _committed(self, done: Committed) -> None:
        ref = done.saved.ref
        self.spec.recorder.checkpoint.remote(ref.step, ref.uri, done.saved.bytes, done.save_s,
                                             done.upload_s)
        self.store.prune(self.spec.checkpoint.keep, protect=self._protect)

    def _not_committed(self, step: int, exc: Exception) -> None:
        self.spec.recorder.warning.remote(f"checkpoint at step {step} was not committed: "
                                          f"{str(exc).splitlines()[0][:200]}")

    def close(self) -> None:
        """Wait for the uploads in flight: the run is not done before its checkpoints are."""
        self.committer.close()


def train_loop_per_worker(config: dict) -> None:
    """The function Ray Train runs on every worker."""
    spec: WorkerSpec = config["spec"]
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    spec.recorder.worker_started.remote(rank, os.getpid(), ray.get_runtime_context().get_node_id())
    if ray.get(spec.recorder.permanent_error.remote()):
        return  # a failure repeated: the driver reports it; restarting again would not help
    session = WorkerSession(spec, rank, ctx.get_world_size())
    try:  # an exception from the trainer's code (setup included) is recorded, then re-raised
        trainer = get_class(spec.trainer["_target_"])(spec.trainer, session)
        session.trainer = trainer
        dataset = load_dataset(spec.data, spec.seed, spec.run_storage)
        session.total_steps = trainer.setup(dataset)
        start = session.restore(trainer)
        session.begin(start)
        if session.rank == 0:
            spec.recorder.group_started.remote(session.world_size, start, time.time(),
                                               session.total_steps)
        if start < session.total_steps:
            trainer.train(start)
        elif session.rank == 0:
            spec.recorder.note.remote(f"run already complete at step {start}; evaluating")
    except Exception as exc:
        error = WorkerError(rank, session.step, type(exc).__name__,
                            (str(exc).strip().splitlines() or [""])[0][:300], traceback.format_exc())
        ray.get(spec.recorder.worker_error.remote(error))
        raise
    finally:
        session.close()
    metrics = trainer.evaluate()
    if session.rank == 0:
        ray.get(spec.recorder.worker_finished.remote(session.step, metrics, time.time()))
