"""The workers' agreement on a preemption notice: one call per node into the run's controller,
and on a one-node run only rank 0's, which it does not wait for.

Every rank's check (worker_api.WorkerContext._agree, about once a second) needs rank 0's
answers to two questions: is there a notice, and rank 0's schedule (the next check, a
time-based save, its last save). Through Ray's public calls that is two barriers
(``ray.train.get_preemption_info()``, then rank 0's broadcast), each one call per rank into the
run's controller, 2-3 ms of its CPU each on a small machine: at 1,024 simulated ranks a check
took 4 s, and with 8 ranks a node 0.17 s here (scripts/bench.py scale; docs/benchmarks.md).
Only rank 0 has anything to say, so here no rank waits for another, only for rank 0's answer:
- rank 0 reads its own notice, as the watcher marked it, and hands it with its proposal to the
  controller (controller_barrier.TrainController.agreement_publish) without waiting, and posts
  it on its node;
- each other node's poster (its local rank 0) asks the controller for it (one call, answered
  once rank 0's arrives: check_answers.py) and posts it on its node;
- the node's other ranks read it there (orchestrator/worker/node_answers.py: a folder of the
  user's own on the node's disk). A rank that shares no disk with its node's poster, or whose
  poster ended before its last check, asks the controller itself: it holds every answer.

It needs the group's barrier in the controller (controller_barrier.py: its key and handle
name the group); where that is missing, the workers take Ray's public calls.
tests/test_ray_internals.py checks what this takes from Ray against the installed Ray.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.train.v2._internal.execution.context import TrainContext, get_train_context

from orchestrator.ray_internals.barrier_handle import HostedBarrier
from orchestrator.worker.node_answers import NotPosted, Poster, Reader

log = logging.getLogger(__name__)

# How long a rank waits for its node's poster before it asks the controller itself (which
# waits as long as the group's collectives do): rank 0 is that late (a save or an evaluation
# of its own), or this rank fell behind the answers the node keeps.
READ_WAIT_S = 10.0


class NodeAgreement:
    """One rank's side of the agreement (``agree``, as worker/start.py's Collective's)."""

    def __init__(self, rank: int, local_rank: int, node: str, barrier: HostedBarrier,
                 notice: Callable[[], Any], base=None):
        self.rank, self._notice, self.barrier = rank, notice, barrier
        self.check = 0
        self.waited_s = 0.0  # rank 0: how long the other nodes waited at its recent checks
        self._waits: ray.ObjectRef | None = None
        self._my_wait = 0.0  # a poster's wait for the controller's answer at its last check
        group = f"{barrier.controller._actor_id.hex()}-{barrier.key}"
        self.leads = local_rank == 0  # the node's first rank: asks (or is rank 0), and posts
        self.poster = Poster(group, node, base) if self.leads else None
        self.reader = None if self.leads else Reader(group, node, base)
        self._direct: bool | None = None  # a reader that shares no disk with its poster

    def agree(self, proposal: Any) -> tuple[Any, Any]:
        """(the notice rank 0 holds, or None; rank 0's ``proposal``), on every rank."""
        self.check += 1
        if self.rank == 0:
            answer = (self._notice(), proposal)
            self._publish(answer)  # held in the controller for any rank that asks
        elif self.leads or self._asks_controller():
            answer = self._ask()
        else:
            try:
                return self.reader.read(self.check, READ_WAIT_S)
            except NotPosted:  # its poster ended first, or is late, or this rank fell behind
                return self._ask()
        if self.poster is not None:
            self._post(answer)
        return answer

    def _ask(self) -> tuple[Any, Any]:
        asked = time.monotonic()
        answer = ray.get(self.barrier.controller.agreement_answer.remote(
            self.barrier.key, self.check, self._my_wait))
        self._my_wait = time.monotonic() - asked
        return answer

    def _post(self, answer: tuple) -> None:
        try:
            self.poster.post(self.check, answer)
        except OSError as exc:  # the node's disk: its ranks find no folder, and ask instead
            log.warning("preemption checks: cannot post on this node (%s): its ranks ask the "
                        "run's controller", exc)
            self.poster.close()
            self.poster = None

    def _asks_controller(self) -> bool:
        if self._direct is None:  # asked once, after the group's first barrier
            self._direct = not self.reader.shares_disk()
            if self._direct:
                log.warning("rank %d finds no folder of its node's first rank at %s (no disk "
                            "shared with it, or it ended): it asks the run's controller at "
                            "each preemption check itself", self.rank, self.reader.folder)
        return self._direct

    def _publish(self, answer: tuple) -> None:
        if self._waits is not None:  # the last publish's: done long ago, never waited for
            done, _ = ray.wait([self._waits], timeout=0)
            self.waited_s = ray.get(done[0]) if done else self.waited_s
        self._waits = self.barrier.controller.agreement_publish.remote(
            self.barrier.key, self.check, answer)

    def close(self) -> None:
        if self.poster is not None:
            self.poster.close()


def for_this_worker(rank: int) -> NodeAgreement | None:
    """This worker's side, made before the group's first barrier (its node's poster makes the
    folder then); None where the group's barrier is not in its controller."""
    context = get_train_context()
    barrier = context.get_synchronization_actor()
    if not (isinstance(barrier, HostedBarrier) and installed()):
        return None
    return NodeAgreement(rank, context.get_local_rank(), ray.util.get_node_ip_address(), barrier,
                         lambda: get_train_context().preemption_context.preemption_info)


def installed() -> bool:
    """What this reads is where Ray 2.58-2.60 keep it (checked in the worker, where it runs)."""
    return ("preemption_context" in getattr(TrainContext, "__dataclass_fields__", {})
            and callable(getattr(TrainContext, "get_synchronization_actor", None)))
