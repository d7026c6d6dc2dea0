"""Retry an operation with exponential backoff until a deadline: outages are waited out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from orchestrator.errors import one_line

T = TypeVar("T")
log = logging.getLogger("orchestrator.checkpoint")


@dataclass(frozen=True)
class Backoff:
    first_s: float = 0.5
    max_s: float = 15.0
    deadline_s: float = 600.0  # give up on this checkpoint after so long; training goes on
    until: float | None = None  # a time.monotonic() no operation retries past (the budget)

    def delays(self):
        delay = self.first_s
        while True:
            yield delay
            delay = min(delay * 2, self.max_s)

    def budget(self) -> Backoff:
        """The same backoff with one deadline for everything done under it from now on (a
        checkpoint's every upload, listing and commit together), not one per operation."""
        return replace(self, until=time.monotonic() + self.deadline_s)

    def end(self, started: float) -> float:
        """When an operation started at ``started`` stops retrying."""
        end = started + self.deadline_s
        return end if self.until is None else min(end, self.until)


DEFAULT_BACKOFF = Backoff()


def with_retries(what: str, operation: Callable[[], T], backoff: Backoff,
                 sleep: Callable[[float], None] = time.sleep,
                 renew: Callable[[OSError], None] | None = None) -> T:
    """``operation()``, retried on OSError until the backoff's deadline; ``renew(error)`` runs
    before each retry (a store opens its connection again on a credentials error)."""
    end = backoff.end(time.monotonic())
    for attempt, delay in enumerate(backoff.delays(), start=1):
        try:
            return operation()
        except OSError as exc:
            if time.monotonic() + delay > end:
                raise
            log.warning("%s failed (attempt %d, retrying in %.1fs): %s", what, attempt, delay,
                        one_line(exc)[:200])
            sleep(delay)
            if renew is not None:
                renew(exc)
    raise AssertionError("unreachable")
