"""A Ray actor on the driver's node that keeps the run record and writes run.json as it goes.

Workers send it events (fire and forget); it lives on the driver's node because the run
directory is there.
"""

from __future__ import annotations

import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator.failure_policy import WorkerError
from orchestrator.record import RunRecord

WRITE_EVERY_S = 1.0


@ray.remote(num_cpus=0)
class RunRecorder:
    def __init__(self, path: str, record: RunRecord):
        self.path = path
        self.record = record
        self._written = 0.0
        self._write(force=True)

    def _write(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._written >= WRITE_EVERY_S:
            self.record.write(self.path)
            self._written = now

    def group_started(self, world_size: int, step: int, at: float) -> None:
        self.record.group_started(world_size, step, at)
        self._write(force=True)

    def progress(self, step: int, samples: int, metrics: dict, at: float) -> None:
        self.record.progress(step, samples, metrics, at)
        self._write()

    def evaluated(self, step: int, metrics: dict) -> None:
        self.record.evaluated(step, metrics)
        self._write(force=True)

    def checkpoint(self, step: int, uri: str, nbytes: int, save_s: float, upload_s: float) -> None:
        self.record.checkpoint(step, uri, nbytes, save_s, upload_s)
        self._write(force=True)

    def warning(self, message: str) -> None:
        self.record.warning(message)
        self._write(force=True)

    def worker_started(self, rank: int, pid: int, node: str) -> None:
        self.record.worker_started(rank, pid, node)
        self._write(force=True)

    def worker_error(self, error: WorkerError) -> bool:
        """Record a worker's exception; True if it is permanent (do not retry)."""
        verdict = self.record.worker_error(error)
        self._write(force=True)
        return verdict.permanent

    def permanent_error(self) -> str | None:
        return self.record.permanent_error

    def preemption_notice(self, step: int, deadline_s: float | None, nodes: list[str], at: float) -> None:
        self.record.preemption_notice(step, deadline_s, nodes, at)
        self._write(force=True)

    def worker_finished(self, step: int, metrics: dict, at: float) -> None:
        self.record.worker_finished(step, metrics, at)
        self._write(force=True)

    def finish(self, status: str, error: str | None) -> dict:
        self.record.finish(status, error, time.time())
        self._write(force=True)
        return self.record.to_dict()


def start_recorder(path: str, record: RunRecord):
    """Start the recorder pinned to this (the driver's) node."""
    node_id = ray.get_runtime_context().get_node_id()
    strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    return RunRecorder.options(scheduling_strategy=strategy).remote(path, record)
