"""The public worker API: what a training function talks to on every worker.

    python -m orchestrator trainer=function trainer.fn=mypkg.train:main +trainer.steps=1000

runs ``main(ctx, cfg)`` on every worker. ``cfg`` is a plain dict holding the composed
``trainer`` and ``data`` config nodes; ``ctx`` is a :class:`WorkerContext`. The built-in
trainers (``trainers/``) are functions like this one. A loop that uses all of it::

    def main(ctx, cfg):
        model = build(cfg["trainer"])
        if (path := ctx.restore()) is not None:            # newest committed checkpoint
            model.load(path / "model.pt")
        batches = ctx.batches(num_rows, global_batch=64)   # the same global batch at any size
        ctx.total_steps = cfg["trainer"]["steps"]
        for step in range(ctx.start_step, ctx.total_steps):
            loss = model.train_on(batches.rows(step))       # this rank's rows of the step
            ctx.step_done(step + 1, {"loss": loss}, samples=64)
            if ctx.should_save(step + 1):
                ctx.save(step + 1, lambda d: model.save(d / "model.pt") if ctx.rank == 0 else None)
            if ctx.should_preempt():                       # saved just above: return now
                return None
        return {"test_accuracy": model.evaluate()}         # rank 0's: the run's metrics

Steps count completed optimizer steps (or boosting rounds): ``step_done(n)`` after the n-th.
Every rank must call ``step_done``, ``should_save``/``save`` and ``should_preempt`` at the
same steps: they agree on preemption notices and on time-based checkpoints there.
No framework is imported here: a checkpoint is whatever files ``write(dir)`` puts in a folder.
"""

from __future__ import annotations

import fnmatch
import json
import numbers
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from orchestrator.checkpoint.committer import Committed, Committer
from orchestrator.checkpoint.policy import CheckpointPolicy
from orchestrator.checkpoint.retry import Backoff
from orchestrator.checkpoint.store import MANIFEST, CheckpointStore, WriteNeverCommits
from orchestrator.data.fingerprint import META_KEY as FINGERPRINT_KEY
from orchestrator.data.order import DataOrder, step_seed
from orchestrator.errors import one_line
from orchestrator.observe.step_reports import StepReports
from orchestrator.worker.preemption_checks import PreemptionChecks
from orchestrator.worker.start import Collective, Start, WorkerSpec

if TYPE_CHECKING:
    from orchestrator.data.datasets import Dataset
    from orchestrator.data.streaming import DataShare


# -- declaring a training function (optional) --------------------------------------------
@dataclass(frozen=True)
class TrainingInfo:
    config: type | None = None  # a dataclass schema for cfg["trainer"], checked before Ray starts
    # More checks on cfg (raise ConfigError); it may return the names of the metrics the run
    # will report (None: unknown), which a sweep's metric is checked against.
    check: Callable[[dict], Iterable[str] | None] | None = None
    step_unit: str = "step"  # what the progress display counts ("round" for boosting)
    streams: bool = False  # reads large parquet data through ctx.stream() (a rank's share)
    # (trainer keys, cluster keys, the cluster keys given on the command line) -> cluster keys
    # to set: a function that knows the run's size from its own keys (torchrun's flags).
    cluster: Callable[[dict, dict, set], dict] | None = None
    # What each CPU worker's process imports as it starts, instead of its backend's
    # (orchestrator/worker/warm.py); None: the backend's.
    warm_imports: tuple[str, ...] | None = None
    # (trainer keys) -> what the run trains on, for a derived run name, in place of the data's
    # name (trainer=script: the script's; its data is its own)
    run_label: Callable[[dict], str] | None = None
    # The function coordinates processes of its own (trainer=tf_ps: parameter servers and
    # workers as Ray actors): Ray Train runs it once (world_size 1), and cfg["cluster"] says
    # how many workers to start (cluster.workers) and with what share of the CPUs.
    coordinates: bool = False


def training_function(config: type | None = None,
                      check: Callable[[dict], Iterable[str] | None] | None = None,
                      step_unit: str = "step", streams: bool = False,
                      cluster: Callable[[dict, dict, set], dict] | None = None,
                      warm_imports: Iterable[str] | None = None,
                      run_label: Callable[[dict], str] | None = None,
                      coordinates: bool = False):
    """Optional decorator: the schema your ``trainer`` keys must fit (a dataclass whose
    ``__post_init__`` may raise ConfigError), extra checks ``check(cfg)`` on what the function
    will get (``{"trainer": ..., "data": ...}``: try your parts on a tiny batch, say), and the
    unit of a step. Bad input then stops the command with one line and exit code 2, before
    any worker starts. ``check`` may return the names of the metrics the run will report
    (those given to ``step_done`` and ``eval_done``, and the returned ones): a sweep whose
    ``hydra.sweeper.metric`` is none of them is then refused before its trials start; None
    says nothing. ``streams``: the function reads data=parquet larger than
    data.stream_above_mb through ``ctx.stream()`` (its share, streamed) rather than
    ``ctx.dataset()`` (the whole data in memory). ``warm_imports``: the modules each CPU
    worker's process imports as it starts, before Ray places it (and each process kept ready
    for a restart), instead of its backend's (torch: orchestrator/ray_internals/
    torch_imports.py); ``module:function`` also calls the function. ``run_label(trainer)``:
    what a derived run name says the run trains on, in place of ``data.name``.
    ``coordinates``: the function runs once (a coordinator) and starts the run's workers
    itself as Ray actors; ``cfg["cluster"]`` holds ``workers``, ``cpus_per_worker`` and
    ``gpus_per_worker`` (trainers/tf_ps/)."""

    def mark(fn):
        warm = tuple(warm_imports) if warm_imports is not None else None
        fn.__training_info__ = TrainingInfo(config, check, step_unit, streams, cluster, warm,
                                            run_label, coordinates)
        return fn

    return mark


def training_info(fn) -> TrainingInfo:
    return getattr(fn, "__training_info__", None) or TrainingInfo()


# -- the data order ------------------------------------------------------------------------
class Batches:
    """The global batch of every step, fixed by (seed, step) whatever the world size, and this
    rank's share of it (every world_size-th row). Steps are 0-based here: ``rows(step)`` is
    what the step after ``step`` completed ones trains on, so a resume continues exactly."""

    def __init__(self, order: DataOrder, rank: int, world_size: int):
        self._order, self._rank, self._world = order, rank, world_size

    @property
    def steps_per_epoch(self) -> int:
        return self._order.steps_per_epoch

    @property
    def global_batch(self) -> int:
        return self._order.global_batch

    @property
    def rows_a_step(self) -> int:
        """The rows every step trains on: the global batch, or all of data smaller than one."""
        return min(self._order.global_batch, self._order.num_rows)

    @property
    def largest_share(self) -> int:
        """The most rows any rank trains on at a step (streamed shards may not split evenly)."""
        return self._order.largest_share(self._world)

    def rows(self, step: int) -> np.ndarray:
        """This rank's row indices of the global batch at ``step``."""
        return self._order.shard(step, self._rank, self._world)

    def global_rows(self, step: int) -> np.ndarray:
        return self._order.global_batch_rows(step)

    def epoch(self, step: int) -> int:
        return self._order.epoch_of(step)

    def position(self, step: int) -> dict:
        """Where the data stream stands after ``step`` completed steps (kept in manifests)."""
        o = self._order
        return {"seed": o.seed, "num_rows": o.num_rows, "global_batch": o.global_batch,
                "next_step": step, "epoch": o.epoch_of(step),
                "batch_in_epoch": step % o.steps_per_epoch}


class StreamedBatches(Batches):
    """Batches of streamed parquet data (data.stream; ctx.stream()): the same global batch at
    any world size, and this rank's rows read from its own row groups, a window at a time.
    ``rows(step)`` are global row ids; ``read`` gives the rows themselves."""

    def __init__(self, order, plan, rank: int, world_size: int, report: Callable[[dict], None]):
        super().__init__(order, rank, world_size)
        self._plan, self._report, self._stream = plan, report, None

    def read(self, start: int, total: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(row ids, features float32, labels) of this rank's share of steps start..total-1,
        features scaled by the mean and spread of a sample of the training rows."""
        self._stream = self._plan.rank_stream(self._order, self._rank, self._world)
        started = time.perf_counter()
        for step, rows in enumerate(self._stream.steps(start, total), start + 1):
            if step % 100 == 0 or step == total:  # read so far, windows read ahead included
                self._report({"bytes_read": self._stream.reader.bytes_read, "from_step": start,
                              "to_step": step, "read_s": round(time.perf_counter() - started, 3)})
            yield rows

    def eval_batches(self, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray, float]]:
        """This rank's held-out rows in batches (x, y, weight): every rank the same number of
        batches, padding ones weighing 0."""
        return iter(self._plan.eval_share(self._order, self._rank, self._world, batch_size))

    def position(self, step: int) -> dict:
        return {**super().position(step), **self._order.position()}


def matching(patterns: Iterable[str]) -> Callable[[str], bool]:
    """A checkpoint file name's test: one of the names or glob patterns (``*`` spans folders)."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    return lambda name: any(fnmatch.fnmatchcase(name, p) for p in patterns)


class CheckpointsCannotCommit(RuntimeError):
    """No checkpoint of the run can commit (two ranks write the same file): not retried."""

    retry = False


class SaveNotOnEveryRank(RuntimeError):
    """``if rank == 0: ctx.save(...)`` (torchrun's habit): no checkpoint could commit."""

    retry = False


class StreamBatchRefused(ValueError):
    """ctx.stream(global_batch) with a batch the shards cannot give (a training function
    whose config has no trainer.batch_size, so the driver could not check it): not retried."""

    retry = False


# -- the context -------------------------------------------------------------------------
class WorkerContext:
    """One per worker, built by the orchestrator before your function is called."""

    rank: int  # 0..world_size-1; rank 0 reports progress and commits checkpoints
    local_rank: int  # rank among the workers on this node
    world_size: int
    seed: int  # the run's seed (seed=...): weights, data order, split
    device_ids: list[int]  # GPUs Ray assigned to this worker (empty on CPU)
    start_step: int  # the step of the checkpoint restore() returns (0 on a fresh start)
    node_rank: int  # this worker's node among the group's nodes (0 holds rank 0)
    local_world_size: int  # workers of this group on this node

    def __init__(self, spec: WorkerSpec, rank: int, local_rank: int, world_size: int,
                 device_ids: list[int], start: Start, collective: Collective, workdir: Path,
                 node_rank: int = 0, local_world_size: int | None = None):
        self.rank, self.local_rank, self.world_size = rank, local_rank, world_size
        self.node_rank = node_rank
        self.local_world_size = world_size if local_world_size is None else local_world_size
        self.seed, self.device_ids, self.start_step = spec.seed, list(device_ids), start.step
        self._spec, self._start, self._collective, self._workdir = spec, start, collective, workdir
        now = time.monotonic()
        self._started_at = time.time()
        self._total: int | None = None
        self._step = start.step
        self._announced = False
        self._restored: Path | None = start.path
        self._restored_bytes = 0  # fetched by restore() (rank 0: its verified copy)
        self._sums_asked = 0  # sum_over_ranks calls: every rank counts the same
        self._policy = CheckpointPolicy(spec.checkpoint.every_steps, spec.checkpoint.every_seconds)
        self._checks = PreemptionChecks(spec.preemption_check_s, start.step, now)
        self._reports = StepReports(spec.recorder) if rank == 0 else None
        self._notice = None  # the preemption notice every rank agreed on
        self._save_at: int | None = None  # a time-based checkpoint agreed for this step
        self._last_saved = start.step  # the resumed checkpoint needs no saving again
        self._batches: Batches | DataShare | None = None  # what a checkpoint's meta["data"] says
        self._dataset: Dataset | None = None
        self._store = CheckpointStore(spec.run_storage)
        self._staging = start.staging
        self._uncommitted: dict[int, str] = {}  # step -> why this rank's part never arrived
        self._never_commits: str | None = None  # why no checkpoint of the run can commit
        self._said_empty = False  # an empty checkpoint was warned about
        self._committer = Committer(
            self._store, rank, world_size, start.attempt, spec.checkpoint.async_upload,
            on_commit=self._committed, on_failure=self._not_committed,
            backoff=Backoff(deadline_s=spec.checkpoint.upload_retry_s))

    # -- restoring -----------------------------------------------------------------------
    def restore(self, files: Iterable[str] | None = None) -> Path | None:
        """A local directory holding the newest committed checkpoint (the files its manifest
        lists and manifest.json, checked against their checksums; on any store, nothing
        else), or None on a fresh start. Every rank gets the same checkpoint, taken at
        ``start_step``. Read it; do not write into it.
        ``files``: the names or glob patterns (``dcp/*``) of the files this rank loads, and
        only those are fetched to it: a rank of a sharded job reads its own shards, not every
        rank's. Called again with others, the same folder gets those too. None: every file
        (rank 0 has them all in any case: it verified the whole checkpoint before the start)."""
        if self._start.ref is None:
            return None
        if self._start.path is not None:
            if not self._restored_bytes:
                listed = json.loads((self._start.path / MANIFEST).read_text())["files"]
                self._restored_bytes = sum(entry["bytes"] for entry in listed.values())
                self._spec.recorder.restored.remote(self.rank, self._restored_bytes)
            return self._start.path
        choose = None if files is None else matching(files)
        self._restored, nbytes = self._start.store.fetch_loaded(
            self._start.ref, self._workdir / "restore", choose or (lambda name: True))
        self._restored_bytes += nbytes
        self._spec.recorder.restored.remote(self.rank, self._restored_bytes)
        return self._restored

    @property
    def total_steps(self) -> int | None:
        """How many steps the run takes, if you say so: the progress display's ETA, and
        ``should_save`` is True at the last step."""
        return self._total

    @total_steps.setter
    def total_steps(self, total: int | None) -> None:
        self._total = None if total is None else int(total)
        self._announce()

    # -- checkpoints ---------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Checkpoint after ``step`` completed steps? The policy (checkpoint.every_steps,
        checkpoint.every_seconds), the last step, and a preemption notice; the same answer on
        every rank."""
        if step <= self._last_saved:
            return False
        if self._notice is not None:
            return True
        # A time-based save agreed at an earlier step_done: due at the next step asked about,
        # whether the loop asks before or after its step_done.
        if self._save_at is not None and self._save_at > self._last_saved and step >= self._save_at:
            return True
        if self._total is not None and step >= self._total:
            return True
        return self._policy.due_by_step(step)

    def save(self, step: int, write: Callable[[Path], Any]) -> None:
        """Every rank, at the same step. ``write(dir)`` writes this rank's files into an empty
        local directory (any format; it may write none, as with replicated state where rank 0
        alone writes). The step waits only for ``write``: the files are uploaded in the
        background, and the checkpoint is committed (manifest written last by rank 0) only
        once every rank's files are stored and their sizes checked.
        ``write`` may instead return a future (anything with ``result()``, such as
        ``torch.distributed.checkpoint.async_save``'s) that finishes the files in the
        background: the upload starts once it resolves, and a future that raises leaves the
        checkpoint uncommitted."""
        self._stop_if_nothing_commits()
        if step <= self._last_saved:
            return
        self._last_saved = step
        if self._reports is not None:
            self._reports.send()  # steps reported before the checkpoint that covers them
        folder = self._staging / f"step_{step:09d}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        started = time.perf_counter()
        pending = write(folder)
        meta = {"step": step, "world_size": self.world_size, "seed": self.seed}
        if self._batches is not None:
            meta["data"] = self._batches.position(step)
        if self._spec.data_files is not None:  # a resume over other data is refused (run_plan)
            meta[FINGERPRINT_KEY] = self._spec.data_files
        self._committer.snapshot(step, folder, meta, time.perf_counter() - started,
                                 pending if callable(getattr(pending, "result", None)) else None)
        self._policy.saved(time.monotonic())

    # -- progress and preemption ---------------------------------------------------------
    def step_done(self, step: int, metrics: Mapping[str, Any] | None = None, samples: int = 0) -> None:
        """After each completed step, on every rank: progress, metrics (rank 0's are the
        curves; values may be tensors, read only when reported), and, about every
        failure.preemption_check_s, the workers' agreement on preemption notices."""
        self._step = step
        self._stop_if_nothing_commits()
        self._announce()
        self._policy.start(time.monotonic())
        final = self._total is not None and step >= self._total
        if self._reports is not None:
            self._reports.add(step, metrics or {}, samples, final)
        if not final and self._checks.due(step):
            self._agree(step)

    def should_preempt(self) -> bool:
        """True on every rank once a preemption notice (a drain, SIGTERM to the node) was
        agreed on: ``should_save`` is True at that step; save, then return. The orchestrator
        waits for the upload and the restart resumes there (no step lost)."""
        return self._notice is not None

    def check_preemption(self) -> bool:
        """For loops that do not step in lockstep (trainer=script's supervisor): every rank
        calls it at the same moments, and its n-th call answers as rank 0's n-th did, True
        once a preemption notice was agreed on."""
        self._agree(self._step)
        return self._notice is not None

    @property
    def preemption_deadline(self) -> float | None:
        """The agreed notice's deadline (seconds since the epoch), or None."""
        info = self._notice
        return info.deadline_ms / 1000 if info is not None and info.deadline_ms else None

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank (a barrier: every rank must call it)."""
        return self._collective.broadcast(value)

    @property
    def run_name(self) -> str:
        return self._spec.run_name

    @property
    def local_dir(self) -> Path:
        """A folder on this node's disk for this worker alone (caches, scratch files): removed
        when the worker ends, and, if it is killed, by the next worker to start or end on the
        node (orchestrator/worker/workdir.py)."""
        folder = self._workdir / "local"
        folder.mkdir(exist_ok=True)
        return folder

    @property
    def max_restarts(self) -> int:
        """failure.max_restarts: how many restarts after a failure the run allows."""
        return self._spec.max_restarts

    def sum_over_ranks(self, values: Iterable[float]) -> np.ndarray:
        """The element-wise sum of a small array over all ranks (held-out metric sums of each
        rank's own rows), the same on every rank; every rank calls it at the same point. Added
        up in rank order by the run's recorder, so the sum does not depend on arrival order."""
        import ray

        values = np.asarray(values, dtype=np.float64)
        if self.world_size == 1:
            return values
        self._sums_asked += 1
        key = f"{self._start.attempt}/{self._sums_asked}"
        recorder = self._spec.recorder
        ray.get(recorder.contribute.remote(key, self.rank, values))
        self._collective.broadcast(None)  # every rank's part is in
        return np.asarray(ray.get(recorder.added_up.remote(key, self.world_size)))

    def groups_before(self) -> int:
        """How many worker groups of this run started before this one (restarts, resizes
        and preemptions); asked of the run's recorder."""
        import ray

        return ray.get(self._spec.recorder.groups_started.remote())

    def output(self, lines: list[str]) -> None:
        """Lines this rank's program printed: kept in the run folder (logs/rank_<r>.log);
        rank 0's are shown on the console."""
        if lines:
            self._spec.recorder.output.remote(self.rank, list(lines))

    def warn(self, message: str) -> None:
        """A warning in run.json and on the console."""
        self._spec.recorder.warning.remote(message)

    def report_processes(self, facts: Mapping[str, Any]) -> None:
        """What a coordinating function's own processes are doing (its servers, their pids
        and addresses, work rescheduled, time away): run.json's "processes", replaced at
        each call."""
        self._spec.recorder.processes.remote(dict(facts))

    def _agree(self, step: int) -> None:
        now = time.monotonic()
        proposal = None
        if self.rank == 0:  # rank 0's clock decides the next check and time-based saves
            proposal = (self._checks.propose(step, now), self._policy.due_by_time(now),
                        self._last_saved)
        info, agreed = self._collective.agree(proposal)  # every rank has rank 0's answer
        # None where Ray's barrier released without rank 0 (its node reclaimed): schedule kept
        interval, save_now, saved_on_0 = agreed or (self._checks.interval, False, self._last_saved)
        if saved_on_0 != self._last_saved:
            # Every rank is at this check, past the same steps: one rank saved where another
            # did not, and rank 0 would wait checkpoint.upload_retry_s for a part never sent.
            raise SaveNotOnEveryRank(
                f"ctx.save() was last called at step {saved_on_0} on rank 0 and at step "
                f"{self._last_saved} on rank {self.rank}: every rank calls save at the same "
                "steps (a rank with nothing to keep passes a write that writes nothing), or no "
                "checkpoint commits")
        # Rank 0 does not wait for the other nodes; they wait for it (as long as its
        # collective saw them wait): the check's cost is theirs, and rank 0 paces the checks.
        took = max(time.monotonic() - now, getattr(self._collective, "waited_s", 0.0))
        self._checks.agreed(step, interval, now, took)
        if save_now:
            self._save_at = step
        if info is not None and self._notice is None:
            self._notice = info
            if self.rank == 0:
                deadline = info.deadline_ms / 1000 if info.deadline_ms else None
                left = deadline - time.time() if deadline else None
                self._spec.recorder.preemption_notice.remote(step, left, info.preempted_node_ids,
                                                            time.time())

    # -- data and evaluation -------------------------------------------------------------
    def batches(self, num_rows: int, global_batch: int,
                replica: tuple[int, int] | None = None) -> Batches:
        """The deterministic order of the rows, in global batches of ``global_batch`` (the
        same at any world size), and this rank's share; checkpoints record its position.
        ``replica``: (this rank's replica, the number of replicas) where several ranks hold
        parts of one model (pipeline or tensor parallel) and read the same rows."""
        index, count = replica or (self.rank, self.world_size)
        self._batches = Batches(DataOrder(self.seed, num_rows, global_batch), index, count)
        self._check_data_position(num_rows, global_batch)
        return self._batches

    @property
    def streamed(self) -> bool:
        """data=parquet is streamed (data.stream): read it with stream(), not dataset()."""
        return self._spec.stream is not None

    def stream(self, global_batch: int,
               replica: tuple[int, int] | None = None) -> StreamedBatches:
        """Streamed parquet data in global batches of ``global_batch``: this rank reads only
        its share (its virtual shards' row groups); checkpoints record the position.
        ``replica``: as for batches()."""
        plan = self._spec.stream
        if plan is None:
            raise RuntimeError("ctx.stream(): this run's data is not streamed (ctx.streamed)")
        if not isinstance(global_batch, numbers.Integral) or global_batch < plan.shards:
            raise StreamBatchRefused(
                f"ctx.stream({global_batch!r}): the global batch must be an integer of at least "
                f"the {plan.shards} virtual shards (data.shards): each gives it a row or more")
        order = plan.order(global_batch)
        if order.steps_per_epoch == 0:
            raise StreamBatchRefused(
                f"ctx.stream({global_batch}): a shard of data.path has fewer training rows than "
                "it gives each global batch: not one step an epoch; a smaller global batch, or "
                "fewer shards (data.shards)")
        facts = {"streamed": True, "shards": plan.shards, "window": plan.window,
                 "rows": plan.manifest.rows, "train_rows": order.num_rows,
                 "files": len(plan.manifest.files), "row_groups": len(plan.manifest.groups),
                 "bytes": plan.manifest.bytes, "steps_per_epoch": order.steps_per_epoch}
        report = partial(self._spec.recorder.data_read.remote, self.rank, facts)
        index, count = replica or (self.rank, self.world_size)
        self._batches = StreamedBatches(order, plan, index, count, report)
        self._check_data_position(order.num_rows, global_batch)
        return self._batches

    def share(self):
        """Streamed parquet without a batch order (boosting): this rank's row groups, read
        one at a time (``train_chunks()``, ``test_chunks()``); a resize re-deals them."""
        if self._spec.stream is None:
            raise RuntimeError("ctx.share(): this run's data is not streamed (ctx.streamed)")
        from orchestrator.data.streaming import DataShare

        share = DataShare(self._spec.stream, self.rank, self.world_size)
        self._batches = share  # its checkpoints keep the data's manifest (a change is refused)
        return share

    def step_seed(self, step: int) -> int:
        """A seed for step ``step``'s randomness on this rank (dropout, augmentation): a
        resumed run replays it exactly."""
        return step_seed(self.seed, step, self.rank)

    def dataset(self) -> Dataset:
        """The configured dataset (data=digits|synthetic|parquet) as numpy arrays with the
        seeded train/test split: every rank loads the same; take your rows with batches()."""
        if self._dataset is None:
            from orchestrator.data.datasets import load_dataset

            self._dataset = load_dataset(self._spec.data, self.seed, self._spec.run_storage)
        return self._dataset

    def should_evaluate(self, step: int) -> bool:
        """run.eval_every_steps says to evaluate after this step (curves, and the metric a
        sweep's early stopping compares); report with eval_done."""
        every = self._spec.eval_every_steps
        final = self._total is not None and step >= self._total
        return bool(every) and step % every == 0 and not final

    def eval_done(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Held-out metrics after ``step`` (rank 0's are recorded)."""
        if self.rank == 0:
            self._spec.recorder.evaluated.remote(step, {k: float(v) for k, v in metrics.items()})

    # -- the orchestrator's side ---------------------------------------------------------
    def _announce(self) -> None:
        if not self._announced and self.rank == 0:
            self._spec.recorder.group_started.remote(self.world_size, self.start_step,
                                                     self._started_at, self._total)
        self._announced = True

    def _check_data_position(self, num_rows: int, global_batch: int) -> None:
        before = self._start.meta.get("data") if self._start.meta else None
        if self.rank == 0 and before and (before["num_rows"], before["global_batch"]) != \
                (num_rows, global_batch):
            self._spec.recorder.warning.remote(
                f"the checkpoint at step {self.start_step} was taken over {before['num_rows']} "
                f"rows in global batches of {before['global_batch']}, this run has {num_rows} "
                f"and {global_batch}: its data order differs from the run it resumes")

    def _committed(self, done: Committed) -> None:
        ref = done.saved.ref
        self._spec.recorder.checkpoint.remote(ref.step, ref.uri, done.saved.bytes, done.save_s,
                                              done.upload_s, done.write_s)
        if done.saved.bytes == 0 and not self._said_empty:
            self._said_empty = True
            self._spec.recorder.warning.remote(
                f"the checkpoint at step {ref.step} holds no data: write(dir) wrote nothing into "
                "the folder it is given on any rank, so a restart has nothing to load")
        try:
            self._store.prune(self._spec.checkpoint.keep, protect=self._start.protect)
        except Exception as exc:  # a listing or deletion error: the checkpoints stay, that is all
            self._spec.recorder.warning.remote(
                f"retention after the checkpoint at step {ref.step} failed: {one_line(exc)[:200]}")

    def _stop_if_nothing_commits(self) -> None:
        """A checkpoint refused for what every checkpoint of the run would do: stop now, not
        after hours of training that no checkpoint keeps (and not retried: it would again)."""
        if self._never_commits is not None:
            raise CheckpointsCannotCommit(self._never_commits)

    def _not_committed(self, step: int, exc: Exception) -> None:
        self._uncommitted[step] = one_line(exc)[:200]
        # The write function's doing: no later checkpoint can commit either.
        if isinstance(exc, WriteNeverCommits):
            self._never_commits = f"the checkpoint at step {step} was not committed: " \
                f"{self._uncommitted[step]}; no checkpoint of this run can be ({exc.advice})"
        self._spec.recorder.warning.remote(
            f"checkpoint at step {step} was not committed (rank {self.rank}): "
            f"{self._uncommitted[step]}")

    def _last_checkpoint_missing(self) -> str | None:
        """After _close(), on rank 0: why the newest checkpoint this worker group saved is not
        committed, or None. A run whose final checkpoint is lost has not succeeded."""
        step = self._last_saved
        if self.rank != 0 or step <= self.start_step:
            return None
        if step in self._committer.committed_steps:
            return None
        why = self._uncommitted.get(step, "its upload did not finish")
        try:  # committed by an earlier attempt? (asked of a store that may be what failed)
            if self._store.is_committed(step):
                return None
        except OSError as exc:
            why = self._uncommitted.get(step, one_line(exc)[:300])
        return f"the checkpoint at step {step} was not committed: {why}"

    def _flush(self) -> None:
        """Wait for the uploads handed over so far (rank 0: until they are committed)."""
        if self._reports is not None:
            self._reports.send()
        self._committer.flush()

    def _close(self) -> None:
        if self._reports is not None:
            self._reports.send()
        self._committer.close()


class WorkerLifecycle:
    """The orchestrator's side of one WorkerContext (orchestrator/worker/loop.py): what happens
    around the training function, which the function itself is not given."""

    def __init__(self, ctx: WorkerContext):
        self._ctx = ctx

    @property
    def step(self) -> int:
        """The last step the function reported done."""
        return self._ctx._step

    @property
    def notice(self) -> Any:
        """The preemption notice every rank agreed on, or None."""
        return self._ctx._notice

    @property
    def staging(self) -> Path:
        """Where this rank's snapshots were written."""
        return self._ctx._start.staging

    def announce(self) -> None:
        """Rank 0: tell the recorder this worker group started (once)."""
        self._ctx._announce()

    def close(self) -> None:
        """Send the last reports and wait for every upload (rank 0: until committed)."""
        self._ctx._close()

    def last_checkpoint_missing(self) -> str | None:
        """After close(), on rank 0: why the newest checkpoint saved is not committed."""
        return self._ctx._last_checkpoint_missing()
