"""Ray Train's failure policy, told the run's own verdict: a worker error the run calls
permanent (orchestrator/driver/failure_policy.py: a NaN loss, the same error at the same step
after a restart, a checkpoint never committed) ends fit() at once.

Ray Train's policy alone counts restarts only: it starts another worker group, whose workers
see the verdict and return at once. That is a new group and process group for nothing, 6-8 s
on 2 cores before the command can say why it failed. The verdict is asked of the run's
recorder, which each worker tells before its exception leaves it.
"""

from __future__ import annotations

import logging

import ray
from ray.train.v2._internal.execution.failure_handling import FailureDecision, FailurePolicy

log = logging.getLogger(__name__)

ASK_TIMEOUT_S = 10.0


class StopOnPermanentErrors(FailurePolicy):
    """Ray Train's own policy (its counts, its decision), with RETRY made RAISE once the
    recorder holds a permanent verdict."""

    def __init__(self, inner: FailurePolicy, recorder):
        super().__init__(inner.failure_config)
        self.inner, self.recorder = inner, recorder

    def make_decision(self, training_failed_error) -> FailureDecision:
        decision = self.inner.make_decision(training_failed_error)
        if decision == FailureDecision.RETRY and self._verdict_is_permanent():
            log.info("[FailurePolicy] RAISE: the run's verdict on a worker error is permanent")
            return FailureDecision.RAISE
        return decision

    def _verdict_is_permanent(self) -> bool:
        try:
            return bool(ray.get(self.recorder.permanent_error.remote(), timeout=ASK_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001  (the next group's workers ask it again)
            log.warning("could not ask the run's recorder for its verdict: %s", exc)
            return False
