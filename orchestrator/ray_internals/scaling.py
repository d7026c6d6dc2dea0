"""Ray Train's scaling policies, adjusted (ray/train/v2/_internal/execution/scaling_policy/).

FixedWithoutRequests: the fixed-size policy without its autoscaler requests, for a run on an
embedded cluster: there is no autoscaler to ask, and the requests go through an
AutoscalingCoordinator actor (a process importing Ray, ~1 CPU-second here) that Ray Train
starts for them on every run (speed).

ElasticInMultiples: the elastic policy sizing worker groups in whole multiples of
cluster.workers_multiple_of (correctness: a model cut into P stages and split T ways needs
P x T workers a copy; Ray's own rounding of this kind exists only for TPU slices).
"""

from __future__ import annotations

from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy
from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy


class FixedWithoutRequests(FixedScalingPolicy):
    def after_controller_start(self, train_run_context) -> None:
        pass  # the base class starts the coordinator's client (and actor) here

    def _maybe_send_resource_request(self) -> None:
        pass

    def _send_resource_request(self) -> None:
        pass

    def _cancel_resource_request(self) -> None:
        pass


class ElasticInMultiples(ElasticScalingPolicy):
    multiple = 1

    def _count_possible_workers(self, reserved_resources) -> int:
        count = super()._count_possible_workers(reserved_resources)
        return count - count % self.multiple


def in_multiples(policy: ElasticScalingPolicy, multiple: int) -> ElasticInMultiples:
    sized = ElasticInMultiples(policy.scaling_config)
    sized.multiple = multiple
    return sized
