"""When to checkpoint: decisions from the step count and the clock, no effects.

Steps decide on every rank alike; the clock is rank 0's, whose answer the workers agree on
(see WorkerContext), so that every rank saves at the same step.
"""

from __future__ import annotations


class CheckpointPolicy:
    def __init__(self, every_steps: int | None, every_seconds: float | None, now: float):
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self._last_time = now  # the clock starts with this attempt

    def due_by_step(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def due_by_time(self, now: float) -> bool:
        return bool(self.every_seconds) and now - self._last_time >= self.every_seconds

    def saved(self, now: float) -> None:
        self._last_time = now
