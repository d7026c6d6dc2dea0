"""Ray Train's preemption watcher, run as a thread of its controller's process.

Ray Train 2.60 starts a PreemptionWatcher actor for every worker group (its PreemptionCallback):
a process importing Ray, ~1.6 CPU-seconds here (scripts/run_cpu.py), paid by every run's start
and again by every restart after a failure, on the cores the new workers are starting on. The
watcher itself is a thread polling Ray's draining nodes every few seconds and telling each
worker when its node drains (``ray.train.get_preemption_info()``, which the orchestrator's
preemption checks read). Here the same watcher class runs in the controller, which outlives
the worker groups and is connected to the same cluster: a new watcher per group, as Ray's,
without a process. Ray's own is turned off with its switch (knobs.PREEMPTION_WATCHER), set
in the driver with this callback (train_hooks.without_unneeded_actors), unless the user set
that switch.
"""

from __future__ import annotations

from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
from ray.train.v2._internal.execution.preemption import PreemptionWatcher


class PreemptionWatchThread(PreemptionCallback):
    def after_worker_group_start(self, worker_group) -> None:
        self._stop_watcher()  # a group that failed to start may not have run the shutdown hook
        node_to_ranks: dict[str, list[int]] = {}
        actors_by_rank = {}
        for worker in worker_group.get_workers():
            rank = worker.distributed_context.world_rank
            node_to_ranks.setdefault(worker.metadata.node_id, []).append(rank)
            actors_by_rank[rank] = worker.actor
        # The class Ray runs as an actor; constructed here, its poll thread runs in this process.
        self._watcher = PreemptionWatcher(node_to_ranks=node_to_ranks,
                                          poll_interval_s=self._poll_interval_s,
                                          worker_actors_by_rank=actors_by_rank)

    def _stop_watcher(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher._stop_event.set()  # its thread ends at its next wait, within a poll
