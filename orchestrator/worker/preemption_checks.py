"""When the workers next agree on preemption notices: about every `every_s` seconds.

Agreeing is a barrier through Ray Train's synchronization barrier, kept in its controller
(orchestrator/ray_internals/controller_barrier.py; a few milliseconds on a small machine): every 10 steps of a 5 ms step it cost 10-15% of DDP's throughput. Every rank
must check at the same steps, so rank 0 times the steps since the last check and proposes the
next one; the proposal is broadcast at each check, so all ranks keep the same schedule.
"""

from __future__ import annotations

GROWTH = 4  # the interval at most quadruples per check: a slow first step does not linger


class PreemptionChecks:
    def __init__(self, every_s: float, start_step: int, now: float):
        self.every_s = every_s
        self.interval = 1  # the first check right after the first step of this attempt
        self.next_step = start_step + 1
        self._last = (start_step, now)

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def propose(self, step: int, now: float) -> int:
        """Rank 0: steps until the next check, from the time the steps since the last took."""
        steps, seconds = step - self._last[0], now - self._last[1]
        if steps <= 0 or seconds <= 0:
            return self.interval
        wanted = int(self.every_s * steps / seconds)
        return max(1, min(wanted, self.interval * GROWTH))

    def agreed(self, step: int, interval: int, now: float) -> None:
        """Every rank, with rank 0's proposal."""
        self.interval = max(1, int(interval))
        self.next_step = step + self.interval
        self._last = (step, now)
