"""When the workers next agree on preemption notices: about every `every_s` seconds.

Agreeing takes rank 0's answer to every rank (orchestrator/ray_internals/preemption_agreement.py:
one call per node into the run's controller, rank 0's not waited for; where its hooks are off,
Ray's public calls, two barriers of one call per rank): every 10 steps of a 5 ms step a barrier
cost 10-15% of DDP's throughput. Every rank must check at the same steps, so rank 0 times the
steps since the last check and proposes the next one; the proposal goes with its answer, so all
ranks keep the same schedule. The checks' own time counts (what the other nodes waited for rank
0's answer, where rank 0 itself does not wait), and where a check takes long they are spaced
out (check_period).
"""

from __future__ import annotations

GROWTH = 4  # the interval at most quadruples per check: a slow first step does not linger
# A check's share of the time at most: where a check itself takes long (Ray's barriers, one call
# per rank into the run's controller: ~4 s at 1,024 ranks on a small machine; one call per
# node: 0.17 s at 128 nodes; scripts/bench.py scale), checks are spaced out so that training
# keeps the rest, not checked at every step.
OWN_SHARE = 0.2


def check_period(every_s: float, took_s: float) -> float:
    """Seconds from one check's start to the next's: every_s, or longer where a check takes
    more than OWN_SHARE of that."""
    return max(every_s, took_s / OWN_SHARE)


class PreemptionChecks:
    def __init__(self, every_s: float, start_step: int, now: float):
        self.every_s = every_s
        self.interval = 1  # the first check right after the first step of this attempt
        self.next_step = start_step + 1
        self._last = (start_step, now)
        self._took = 0.0  # how long the last check took (rank 0's clock decides)

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def propose(self, step: int, now: float) -> int:
        """Rank 0: steps until the next check, from the time the steps since the last took."""
        steps, seconds = step - self._last[0], now - self._last[1]
        if steps <= 0 or seconds <= 0:
            return self.interval
        wanted = int(check_period(self.every_s, self._took) * steps / seconds)
        return max(1, min(wanted, self.interval * GROWTH))

    def agreed(self, step: int, interval: int, now: float, took_s: float = 0.0) -> None:
        """Every rank, with rank 0's proposal; ``now``: when the check began, ``took_s``: how
        long it took."""
        self.interval = max(1, int(interval))
        self.next_step = step + self.interval
        self._last = (step, now)
        self._took = took_s
