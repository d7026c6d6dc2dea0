"""Ray Train's fixed-size scaling policy without its autoscaler requests, for a run on an
embedded cluster: there is no autoscaler to ask, and the requests go through an
AutoscalingCoordinator actor (a process importing Ray, ~1 CPU-second here) that Ray Train
starts for them on every run (ray/train/v2/_internal/execution/scaling_policy/)."""

from __future__ import annotations

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
