"""Rank 0's answers to the workers' preemption checks, held in the run's controller for the
other nodes (preemption_agreement.py): a check is one call from rank 0 and one from each other
node's poster, answered on the controller's event loop. No barrier: no rank waits for another,
only for rank 0's answer.

Each worker group (a key of controller_barrier._Host) has its own; the group's shutdown fails
the calls still waiting, as Ray's barrier fails its waiters (SynchronizationBarrierResetError).
No framework and nothing of Ray here: tests/test_check_answers.py runs it on a bare event loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

KEEP = 64  # checks remembered: a poster further behind rank 0 than this is told so


class Answers:
    def __init__(self, timeout_s: float | None = None):
        self.timeout_s = timeout_s  # the group's collective timeout (Ray's barrier's)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._answers: dict[int, asyncio.Future] = {}
        self._published: dict[int, float] = {}
        self._spread: dict[int, float] = {}  # from rank 0's answer to the last poster's
        self._closed: BaseException | None = None

    def _future(self, check: int) -> asyncio.Future:
        if self._closed is not None:
            raise self._closed
        if self._published and check <= max(self._published) - KEEP:
            raise LookupError(f"check {check} is more than {KEEP} checks behind rank 0's")
        self._loop = self._loop or asyncio.get_running_loop()
        return self._answers.setdefault(check, self._loop.create_future())

    def publish(self, check: int, answer: Any) -> float:
        """Rank 0's answer of ``check``; returns how long the last poster of the check before
        waited for rank 0's (the check's cost to the other nodes, which rank 0 cannot see)."""
        future = self._future(check)
        if not future.done():
            future.set_result(answer)
        self._published[check] = time.monotonic()
        for old in [c for c in self._answers if c <= check - KEEP]:
            for kept in (self._answers, self._published, self._spread):
                kept.pop(old, None)
        return self._spread.get(check - 1, 0.0)

    async def answer(self, check: int) -> Any:
        future = self._future(check)
        try:
            answer = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"rank 0 did not reach preemption check {check} within "
                               f"{self.timeout_s:.0f} s") from None
        except asyncio.CancelledError:
            if self._closed is not None and future.cancelled():
                raise self._closed from None
            raise
        waited = time.monotonic() - self._published.get(check, time.monotonic())
        self._spread[check] = max(self._spread.get(check, 0.0), waited)
        return answer

    def close(self, error: BaseException) -> None:
        """The group is shut down: calls waiting, and later ones, raise ``error``. From any
        thread."""

        def fail() -> None:
            self._closed = error
            for future in self._answers.values():
                future.cancel()  # an answer's awaiter raises ``error``; no one else sees it

        if self._loop is None or self._loop.is_closed():
            self._closed = error
        else:
            self._loop.call_soon_threadsafe(fail)
