"""A run never waits silently for workers the cluster cannot place.

Ray Train retries a worker group that does not start forever (its controller failure limit is
-1), so a request the cluster can never satisfy (4 workers of 1 CPU on a 1-CPU cluster) printed
"asking Ray for ..." and then nothing. The driver watches instead: when no worker group has run
for cluster.placement_timeout_s, it says what was asked and what each node has, and stops the
run (exit 1, run.json written). Where the workers were placed but their processes die as they
start (and hold the CPUs while the raylet starts others), it says so instead of "no room",
with the exception those processes left in this node's raylet.err.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import ray

from orchestrator.ray_internals.cluster import (
    free_resources_per_node,
    last_error_line,
    log_size,
    placed_but_not_started,
    raylet_error_log,
)

log = logging.getLogger("orchestrator")

POLL_S = 1.0


def describe_nodes() -> str:
    """'2 nodes: 10.0.0.1 CPU 1/2 free, ...', from Ray's view of the cluster now."""
    free = free_resources_per_node()
    parts = []
    alive = [n for n in ray.nodes() if n.get("Alive")]
    for node in alive:
        total = node.get("Resources", {})
        avail = free.get(node.get("NodeID"), {})
        shown = [k for k in ("CPU", "GPU") if total.get(k)]
        shown += sorted(k for k in total if not k.startswith(("node:", "CPU", "GPU", "memory",
                                                              "object_store_memory")))
        text = ", ".join(f"{k} {avail.get(k, 0):g}/{total[k]:g} free" for k in shown)
        parts.append(f"{node.get('NodeManagerAddress')} {text or 'nothing'}")
    return f"{len(alive)} node{'s' if len(alive) != 1 else ''}: " + "; ".join(parts)


class PlacementWatch:
    """Polls how long the run has had no worker group (waiting_s) and, past timeout_s, calls
    stop() once with the reason."""

    def __init__(self, waiting_s: Callable[[], float | None], timeout_s: float, asked: str,
                 stop: Callable[[], None]):
        self.waiting_s, self.timeout_s, self.asked, self.stop = waiting_s, timeout_s, asked, stop
        self.reason: str | None = None
        self._raylet_log = raylet_error_log()
        self._log_from = log_size(self._raylet_log)  # what this run adds to it, not before
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="placement-watch", daemon=True)

    def __enter__(self) -> PlacementWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(POLL_S):
            try:
                waited = self.waiting_s()
            except Exception as exc:  # the recorder going away ends the run anyway
                log.debug("placement watch: %s", exc)
                continue
            if waited is not None and waited > self.timeout_s:
                self.reason = timeout_reason(self.asked, waited, self.timeout_s,
                                             self._raylet_log, self._log_from)
                self.stop()
                return


def timeout_reason(asked: str, waited: float, timeout_s: float, raylet_log: Path | None = None,
                   log_from: int = 0) -> str:
    """Why no worker group ran: no room, or room and worker processes that die as they
    start (their held CPUs make the cluster look full). A traceback this run's processes left
    in this node's raylet.err (from byte log_from) is quoted where they were placed here."""
    limit = f"after {waited:.0f} s (cluster.placement_timeout_s={timeout_s:g})"
    stuck = placed_but_not_started()
    if not stuck:
        return f"cluster: no room for {asked} {limit}; the cluster has {describe_nodes()}"
    nodes = {n.get("NodeID"): n.get("NodeManagerAddress") for n in ray.nodes()}
    where = ", ".join(nodes.get(n) or n for n in stuck)
    text = (f"cluster: {asked} were placed on {where}, but their processes did not start "
            f"{limit}: a Python process there fails as it starts")
    here = ray.get_runtime_context().get_node_id()
    seen = last_error_line(raylet_log, log_from) if raylet_log and here in stuck else None
    if seen:
        return f"{text} ({seen}; {raylet_log})"
    return f"{text}; Ray's raylet.err on that node says why"
