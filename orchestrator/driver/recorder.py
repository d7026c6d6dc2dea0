"""A Ray actor on the driver's node that keeps the run record and writes run.json as it goes.

Workers send it events (fire and forget); it lives on the driver's node because the run
directory is there. It is also where the run becomes visible: Ray metrics, TensorBoard
curves, and the notices and progress the driver prints (see orchestrator/observe/).
"""

from __future__ import annotations

import os
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator.driver.failure_policy import WorkerError
from orchestrator.driver.record import RunRecord
from orchestrator.observe.progress import ProgressState
from orchestrator.observe.rate import Rate
from orchestrator.observe.tracebacks import ConsoleTracebacks

WRITE_EVERY_S = 1.0
PUBLISH_EVERY_S = 1.0  # Ray drops a gauge not set for a while: refresh them, events or not
CHECKPOINT_NOTICE_EVERY_S = 10.0  # frequent checkpoints: one line per 10 s, with a count


def size(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


class WriteThrottle:
    """run.json written at most every ``every_s``, and never left behind: a write skipped
    within the interval is due at the next ask past it (the recorder asks at each poll)."""

    def __init__(self, every_s: float, clock=time.monotonic):
        self.every_s, self.clock = every_s, clock
        self.last, self.skipped = float("-inf"), False

    def due(self, force: bool = False) -> bool:
        now = self.clock()
        if force or now - self.last >= self.every_s:
            self.last, self.skipped = now, False
            return True
        self.skipped = True
        return False


@ray.remote(num_cpus=0)
class RunRecorder:
    def __init__(self, path: str, record: RunRecord, tensorboard_dir: str | None = None,
                 metrics: bool = True, tracked: bool = False):
        self.path = path
        self.record = record
        self.rate = Rate()
        self.notices: list[tuple[str, str]] = []  # (level, message) for the driver to print
        self._failed_ranks: set[int] = set()  # this group's failures already told
        self._checkpoints_untold = 0
        self._checkpoint_told_at = float("-inf")
        self._sums: dict[str, list] = {}  # sum_over_ranks: key -> [{rank: part}, ranks asked]
        self._rank0_tracebacks = ConsoleTracebacks()  # a dead peer's traceback shortened
        self.curves = None
        if tensorboard_dir:
            from orchestrator.observe.curves import Curves

            self.curves = Curves(tensorboard_dir)
        # The points a tracking server gets (orchestrator/tracking/), the driver takes them
        # with each snapshot: [(step, time, {tag: value}, {run tag: text})], the first at
        # index _tracked_from.
        self._tracked: list | None = [] if tracked else None
        self._tracked_from = 0
        self.metrics = None
        if metrics:
            from orchestrator.observe.metrics import RunMetrics

            self.metrics = RunMetrics(record.run_name, record.trainer)
        self._writes = WriteThrottle(WRITE_EVERY_S)
        self._published = float("-inf")
        # Since when the run has had no worker group: from its start, and again from each
        # group's failure until a worker of the next one starts (orchestrator/driver/placement_watch.py).
        self._no_group_since: float | None = time.monotonic()
        self._write(force=True)

    def _write(self, force: bool = False) -> None:
        if self._writes.due(force):
            self.record.write(self.path)
            if self.curves:
                self.curves.flush()
        self._publish(force)

    def _publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.metrics and (force or now - self._published >= PUBLISH_EVERY_S):
            self.metrics.update(self.record, self.rate.samples_per_s(), self.rate.step_s())
            self._published = now

    def _points(self, step: int, values: dict, at: float | None = None,
                tags: dict | None = None) -> None:
        """One step's values by TensorBoard tag: the curves', and the tracking server's (with
        the run's tags this step set)."""
        if self.curves:
            self.curves.add(step, values, at)
        if self._tracked is not None:
            self._tracked.append((step, at or time.time(), values, tags or {}))

    def _notice(self, message: str, level: str = "INFO") -> None:
        self.notices.append((level, message))

    def group_started(self, world_size: int, step: int, at: float,
                      total_steps: int | None = None) -> None:
        self._show_held_lines()  # an earlier group's unfinished traceback
        before = self._world_size() or 0
        lost = self.record.lost_steps
        kind = self.record.group_started(world_size, step, at, total_steps)
        self.rate.reset()
        self._failed_ranks.clear()
        workers = self._workers_shown() or f"{world_size} worker{'s' if world_size != 1 else ''}"
        if kind == "start":
            verb = f"resuming at step {step}" if step else "from step 0"
            of = f" of {total_steps}" if total_steps else ""
            self._notice(f"{workers} started, training {verb}{of}")
        elif kind == "restart":
            again = self.record.lost_steps - lost
            resized = f" (from {before})" if before and before != world_size else ""
            self._notice(f"restart {self.record.restarts} after a worker failure: {workers}"
                         f"{resized} resume from the checkpoint at step {step} ({again} steps to "
                         "compute again)", "WARNING")
        elif kind == "preemption":
            self._notice(f"after the preemption: {workers} resume at step {step}", "WARNING")
        else:
            self._notice(f"resized from {before} to {world_size} workers at step {step}", "WARNING")
        self._points(step, {"cluster/world_size": world_size,
                            "cluster/restarts": self.record.restarts})
        self._write(force=True)

    def progress(self, step: int, samples: int, metrics: dict, at: float,
                 points: list | None = None) -> None:
        self.record.progress(step, samples, metrics, at)
        self.rate.add(at, step, samples)
        if self.curves or self._tracked is not None:
            for point_step, point_metrics in points or [(step, metrics)]:
                self._points(point_step, {f"train/{k}": v for k, v in point_metrics.items()}, at)
            self._points(step, {"perf/samples_per_s": self.rate.samples_per_s(),
                                "perf/step_seconds": self.rate.step_s(),
                                "cluster/world_size": self._world_size()}, at)
        self._write()

    def _workers_shown(self) -> str | None:
        """A coordinating trainer's words for its own processes (its "shown"), if it said."""
        return (self.record.processes or {}).get("shown")

    def _world_size(self) -> int | None:
        return self.record.world_sizes[-1]["size"] if self.record.world_sizes else None

    def evaluated(self, step: int, metrics: dict) -> None:
        self.record.evaluated(step, metrics)
        self._points(step, {f"eval/{k}": v for k, v in metrics.items()})
        self._write(force=True)

    def checkpoint(self, step: int, uri: str, nbytes: int, save_s: float, upload_s: float,
                   write_s: float = 0.0) -> None:
        self.record.checkpoint(step, uri, nbytes, save_s, upload_s, write_s)
        self._checkpoints_untold += 1
        now = time.monotonic()
        if step == self.record.total_steps or now - self._checkpoint_told_at >= CHECKPOINT_NOTICE_EVERY_S:
            more = self._checkpoints_untold - 1
            written = f"written in the background {write_s:.2f} s, " if write_s else ""
            self._notice(f"checkpoint committed: step {step}, {size(nbytes)} (save {save_s:.2f} s, "
                         f"{written}upload {upload_s:.2f} s)"
                         + (f"; {more} more since the last line" if more else ""))
            self._checkpoints_untold, self._checkpoint_told_at = 0, now
        self._points(step, {"checkpoint/save_seconds": save_s,
                            "checkpoint/upload_seconds": upload_s},
                     tags={"checkpoint.latest": uri,  # and each by its folder's name
                           f"checkpoint.{uri.rstrip('/').rsplit('/', 1)[-1]}": uri})
        self._write(force=True)

    def checkpoint_found(self, step: int, uri: str, nbytes: int) -> None:
        """A committed checkpoint of this run the record may lack (see RunRecord)."""
        if self.record.checkpoint_found(step, uri, nbytes):
            self._write(force=True)

    def warning(self, message: str) -> None:
        self.record.warning(message)
        self._notice(message, "WARNING")
        self._write(force=True)

    def data_read(self, rank: int, facts: dict, read: dict) -> None:
        """Streamed data: what it is (``facts``), and what rank ``rank`` read so far."""
        data = self.record.data = self.record.data or {**facts, "ranks": {}}
        data["ranks"][str(rank)] = read
        self._write()

    def processes(self, facts: dict) -> None:
        """A coordinating function's own processes (WorkerContext.report_processes)."""
        self.record.processes = facts
        self._write()

    def note(self, message: str, level: str = "INFO") -> None:
        """A worker's line for the user's terminal (workers' own output is Ray's business)."""
        self._notice(message, level)

    def output(self, rank: int, lines: list[str]) -> None:
        """A program's printed lines (trainer=script): all ranks' in logs/rank_<r>.log beside
        run.json, rank 0's on the console too."""
        folder = os.path.join(os.path.dirname(self.path), "logs")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank_{rank}.log"), "a", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)
        if rank == 0:
            shown = self._rank0_tracebacks.feed(lines)
            self.notices.extend(("INFO", f"[rank0] {line}") for line in shown)

    def contribute(self, key: str, rank: int, values) -> None:
        """A rank's part of a sum over the ranks (WorkerContext.sum_over_ranks)."""
        self._sums.setdefault(key, [{}, 0])[0][rank] = values

    def added_up(self, key: str, world_size: int):
        """The parts of ``key`` added in rank order; forgotten once every rank has asked."""
        parts, asked = self._sums[key]
        total = sum((parts[r] for r in sorted(parts)), start=0.0)
        if asked + 1 == world_size:
            del self._sums[key]
        else:
            self._sums[key][1] = asked + 1
        return total

    def groups_started(self) -> int:
        return len(self.record.world_sizes)

    def worker_started(self, rank: int, pid: int, node: str) -> None:
        if self.record.worker_started(rank, pid, node):
            self._failed_ranks.clear()  # a new group: its failures are new ones
        self._no_group_since = None
        self._write(force=True)

    def restored(self, rank: int, nbytes: int) -> None:
        """The bytes of the checkpoint a worker of the current group fetched to load it."""
        self.record.restored(rank, nbytes)
        self._write()

    def waiting_s(self) -> float | None:
        """Seconds the run has waited for a worker group to start, or None while one runs."""
        since = self._no_group_since
        return None if since is None else time.monotonic() - since

    def worker_error(self, error: WorkerError) -> bool:
        """Record a worker's exception; True if it is permanent (do not retry)."""
        verdict = self.record.worker_error(error)
        self._failed_ranks.add(error.rank)
        self._notice(f"worker rank {error.rank} failed at step {error.step}: {error.kind}: "
                     f"{error.message} ({verdict.reason})", "WARNING")
        self._write(force=True)
        return verdict.permanent

    def group_failed(self, errors: dict[int, str]) -> None:
        """Ray Train saw workers fail (a killed process included, which reports nothing)."""
        if self._no_group_since is None:
            self._no_group_since = time.monotonic()
        self.record.group_failed()
        lost = sorted(rank for rank in errors if rank not in self._failed_ranks)
        for rank in lost:
            self._failed_ranks.add(rank)
            self.record.worker_lost(rank, errors[rank])
            self._notice(f"fault: worker rank {rank} at step {self.record.steps}: {errors[rank]}",
                         "WARNING")
        if lost:
            self._write(force=True)

    def snapshot_checkpoints(self) -> list[int]:
        """The steps of the checkpoints this run committed, oldest first."""
        return [c["step"] for c in self.record.checkpoints]

    def permanent_error(self) -> str | None:
        return self.record.permanent_error

    def failure_line(self) -> str | None:
        return self.record.failure_line()

    def preemption_notice(self, step: int, deadline_s: float | None, nodes: list[str], at: float) -> None:
        self.record.preemption_notice(step, deadline_s, nodes, at)
        left = f"{deadline_s:.0f}" if deadline_s is not None else "?"
        self._notice(f"preemption notice for {nodes} (deadline in {left} s): "
                     f"checkpointing at step {step}", "WARNING")
        self._write(force=True)

    def worker_finished(self, step: int, metrics: dict, at: float) -> None:
        self.record.worker_finished(step, metrics, at)
        self._points(step, {f"eval/{k}": v for k, v in metrics.items()}, at)
        self._write(force=True)

    def snapshot(self, cursor: int = 0, tracked_from: int | None = None) -> ProgressState:
        """What the driver shows: the count, throughput, and the notices after `cursor`; with
        `tracked_from`, the tracked points from there (those before it were taken)."""
        # The driver polls twice a second: this keeps the gauges fresh, and run.json too when
        # the last report came within WRITE_EVERY_S of a write and nothing came after it (a
        # run held at a step, a long evaluation): its readers see what the console shows.
        if self._writes.skipped:
            self._write()
        else:
            self._publish()
        r = self.record
        tracked = self._take_tracked(tracked_from)
        return ProgressState(r.steps, r.total_steps, self._world_size(), r.samples_per_s,
                             self.rate.step_s(), dict(r.train_metrics), self.notices[cursor:],
                             len(self.notices), self._workers_shown(), tracked,
                             self._tracked_from + len(tracked))

    def _take_tracked(self, tracked_from: int | None) -> list:
        if self._tracked is None or tracked_from is None:
            return []
        del self._tracked[:max(0, tracked_from - self._tracked_from)]
        self._tracked_from = max(self._tracked_from, tracked_from)
        return list(self._tracked)

    def _show_held_lines(self) -> None:
        self.notices.extend(("INFO", f"[rank0] {line}") for line in self._rank0_tracebacks.flush())

    def finish(self, status: str, error: str | None) -> dict:
        self._show_held_lines()
        self.record.finish(status, error, time.time())
        self._write(force=True)
        if self.curves:
            self.curves.close()
        return self.record.to_dict()


def start_recorder(path: str, record: RunRecord, tensorboard_dir: str | None = None,
                   metrics: bool = True, tracked: bool = False):
    """Start the recorder pinned to this (the driver's) node."""
    node_id = ray.get_runtime_context().get_node_id()
    strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    return RunRecorder.options(scheduling_strategy=strategy).remote(path, record, tensorboard_dir,
                                                                   metrics, tracked)
