"""When to checkpoint: a pure decision from the step count and the clock."""

from __future__ import annotations


class CheckpointPolicy:
    def __init__(self, every_steps: int | None, every_seconds: float | None):
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self._last_step = 0
        self._last_time: float | None = None

    def should_save(self, step: int, now: float) -> bool:
        if self._last_time is None:
            self._last_time = now  # the clock starts with the first step of this attempt
        if step <= self._last_step:
            return False
        if self.every_steps and step % self.every_steps == 0:
            return True
        return bool(self.every_seconds and now - self._last_time >= self.every_seconds)

    def saved(self, step: int, now: float) -> None:
        self._last_step = step
        self._last_time = now
