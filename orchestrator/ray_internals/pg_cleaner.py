"""Ray Train's placement-group cleaner, pinned to the cluster it runs in.

The cleaner (a detached actor) asks Ray's state API every second whether the run's controller
is alive, and removes the workers' placement group once it is not: a sweep's early-stopped
trial gives its CPUs back that way. The state API is called without an address, so it resolves
RAY_ADDRESS, else the cluster `ray start` last recorded on the machine. On an embedded Ray
that is another (often long gone) cluster: each call then waited 40 s for its GCS and raised,
so the cleaner never cleaned, and every run's end waited 12 s for it to stop (measured: a third
of a short sweep trial). Pinned, a call takes ~10 ms.

Private Ray Train classes: if an upgrade renames them, launch keeps Ray's own cleaner.
"""

from __future__ import annotations

import os

import ray
from ray.train.v2._internal.callbacks import placement_group_callback
from ray.train.v2._internal.execution.controller.placement_group_cleaner import (
    PlacementGroupCleaner,
)


class PinnedPlacementGroupCleaner(PlacementGroupCleaner):
    def __init__(self, *args, **kwargs):
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        super().__init__(*args, **kwargs)


class PinnedPlacementGroupCleanerCallback(placement_group_callback.PlacementGroupCleanerCallback):
    def after_controller_start(self, train_run_context) -> None:
        # Runs in the controller's process, which creates the cleaner from this module name.
        placement_group_callback.PlacementGroupCleaner = PinnedPlacementGroupCleaner
        super().after_controller_start(train_run_context)
