"""Rank 0's answers to the workers' preemption checks, held in the run's controller for the
other nodes (preemption_agreement.py): a check is one call from rank 0 and one from each other
node's poster, answered on the controller's event loop. No barrier: no rank waits for another,
only for rank 0's answer.

Each worker group (a key of controller_barrier._Host) has its own; the group's shutdown fails
the calls still waiting, as Ray's barrier fails its waiters (SynchronizationBarrierResetError).
No framework and nothing of Ray here: tests/test_node_agreement.py runs it on a bare event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

# Checks remembered: a rank further behind rank 0 than this (ranks that step in lockstep are
# at most one check apart; ~17 minutes of checks a second) is told so, not answered wrongly.
KEEP = 1024


class Answers:
    def __init__(self, timeout_s: float | None = None):
        self.timeout_s = timeout_s  # the group's collective timeout (Ray's barrier's)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._answers: dict[int, asyncio.Future] = {}
        self._newest = 0  # rank 0's newest check
        # The longest waits the posters reported: since rank 0's last answer, and before it
        self._waited = [0.0, 0.0]
        self._closed: BaseException | None = None

    def _future(self, check: int) -> asyncio.Future:
        if self._closed is not None:
            raise type(self._closed)(*self._closed.args)  # one of its own for each caller
        if check <= self._newest - KEEP:
            raise LookupError(f"preemption check {check} is more than {KEEP} checks behind "
                              f"rank 0's ({self._newest}): this rank fell behind the others")
        self._loop = self._loop or asyncio.get_running_loop()
        return self._answers.setdefault(check, self._loop.create_future())

    def publish(self, check: int, answer: Any) -> float:
        """Rank 0's answer of ``check``; returns the longest time a poster said it waited at
        its last check, over rank 0's last two answers (what a check costs the other nodes,
        which rank 0, not waiting, cannot see)."""
        future = self._future(check)
        if not future.done():
            future.set_result(answer)
        self._newest = max(self._newest, check)
        self._answers.pop(check - KEEP, None)  # checks go up one at a time: one falls out
        waited, self._waited = max(self._waited), [0.0, self._waited[0]]
        return waited

    async def answer(self, check: int, waited_s: float = 0.0) -> Any:
        """Rank 0's answer of ``check``, once it is there. ``waited_s``: how long the caller
        waited for its answer at its last check."""
        self._waited[0] = max(self._waited[0], waited_s)
        future = self._future(check)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"rank 0 did not reach preemption check {check} within "
                               f"{self.timeout_s:.0f} s") from None
        except asyncio.CancelledError:
            if self._closed is not None and future.cancelled():
                raise type(self._closed)(*self._closed.args) from None
            raise

    def close(self, error: BaseException) -> None:
        """The group is shut down: calls waiting, and later ones, raise ``error``'s kind. From
        any thread."""

        def fail() -> None:
            self._closed = error
            for future in self._answers.values():
                future.cancel()  # an answer's awaiter raises ``error``; no one else sees it

        if self._loop is None:
            self._closed = error
            return
        try:
            self._loop.call_soon_threadsafe(fail)
        except RuntimeError:  # its loop is closed: no call waits any more
            self._closed = error
