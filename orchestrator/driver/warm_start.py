"""Worker processes started while the driver is still planning (cluster.prestart).

A Ray actor normally gets a new Python process when it is placed: the controller, its helper
actors and every training worker each wait for one to start and import Ray, one after the
other, on a machine whose CPUs were idle while the driver read its config and started the
recorder. Asked for right after Ray starts, the processes are ready when the actors come
(ray_internals/prestart.py). Ray gives a waiting process only to an actor of the same runtime
environment: the workers' variables are therefore the job's (no worker_runtime_env of
their own), and the processes are asked for with the environment Ray Train gives its actors.
"""

from __future__ import annotations

import logging
import math
import threading

from orchestrator.ray_internals.prestart import prestart_workers, train_actor_env

log = logging.getLogger(__name__)

# Ray Train's actors beside the workers, in the run's environment: the controller, its
# autoscaling coordinator, the synchronization actor and the preemption watcher.
HELPERS = 4
KEEP_ALIVE_S = 60  # an unused process ends after this
BATCH_GAP_S = 1.0  # Ray starts as many processes at once as the node has CPUs; the rest wait


class WarmStart:
    """A background thread asking this node's raylet for ``count`` processes, ``batch`` at a
    time (more at once are refused, not queued)."""

    def __init__(self, job_env: dict[str, str], count: int, batch: int):
        self.env, self.count, self.batch = train_actor_env(job_env), count, max(1, batch)
        self._stop = threading.Event()
        self.problem: str | None = None
        self._thread = threading.Thread(target=self._run, name="warm-start", daemon=True)

    def __enter__(self) -> WarmStart:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def _run(self) -> None:
        left = self.count
        for _ in range(math.ceil(self.count / self.batch)):
            self.problem = prestart_workers(min(self.batch, left), KEEP_ALIVE_S, self.env)
            if self.problem:
                log.debug("no worker processes started ahead: %s", self.problem)
                return
            left -= self.batch
            if self._stop.wait(BATCH_GAP_S):
                return


def processes_wanted(workers: int, cpus_per_worker: float | None, node_cpus: float) -> int:
    """The training workers this node can hold (all of them on one machine), and the helpers."""
    fits = workers if not cpus_per_worker else min(workers, int(node_cpus // cpus_per_worker))
    return fits + HELPERS
