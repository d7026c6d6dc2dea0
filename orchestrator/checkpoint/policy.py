"""When to checkpoint: decisions from the step count and the clock, no effects.

Steps decide on every rank alike; the clock is rank 0's, whose answer the workers agree on
(see WorkerContext), so that every rank saves at the same step.
"""

from __future__ import annotations


class CheckpointPolicy:
    def __init__(self, every_steps: int | None, every_seconds: float | None):
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        # The clock starts when the attempt's first step ends: start-up (Ray, restore, the
        # first step's warm-up) is not training time (seen: every_seconds=2 saved at step 1).
        self._last_time: float | None = None

    def start(self, now: float) -> None:
        if self._last_time is None:
            self._last_time = now

    def due_by_step(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def due_by_time(self, now: float) -> bool:
        return (bool(self.every_seconds) and self._last_time is not None
                and now - self._last_time >= self.every_seconds)

    def saved(self, now: float) -> None:
        self._last_time = now
