"""Runs in Ray Train's controller and tells the run's recorder as soon as workers fail.

Apart from recorder.py so that the recorder's own process never imports ray.train (with
ray.data and pandas, ~0.5 CPU-s of a process started on every run's critical path).
"""

from __future__ import annotations

from ray.train import UserCallback


class FaultReporter(UserCallback):
    """Runs in Ray Train's controller and tells the recorder as soon as workers fail."""

    def __init__(self, recorder):
        self.recorder = recorder

    def after_exception(self, run_context, worker_exceptions: dict) -> None:
        self.recorder.group_failed.remote({
            rank: f"{type(exc).__name__}: " + next(
                (ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")[:200]
            for rank, exc in worker_exceptions.items()})
