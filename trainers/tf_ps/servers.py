"""The processes of parameter-server training, as Ray actors: P parameter servers and N workers,
each a ``tf.distribute.Server`` on a port chosen on its own node, and the coordinator's
``ParameterServerStrategy`` over them.

Not Ray Train's worker group, which restarts every worker when one fails: that would defeat
the strategy, whose point is that a lost worker does not stop the others. Here Ray restarts a
lost worker's actor (on the same node: it holds its node's share of the CPUs) and a keeper
thread starts its server again at the same address, where TensorFlow's coordinator finds it
and gives it work again; its closures in flight went to the other workers meanwhile. A lost
parameter server holds variables no one else has: ``lost`` says so, and the coordinator's
function raises, so that the run restarts from its newest checkpoint.

A user's own coordinator loop uses the same class::

    with ParameterServers(workers=4, ps=1, cpus=0.4) as servers:
        coordinator = tf.distribute.coordinator.ClusterCoordinator(servers.strategy)
        ...
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from orchestrator.driver.ports import PortHold

PLACEMENT_S = 300.0  # how long the servers may wait for room on the cluster
# TensorFlow's connection of the coordinator to its servers was seen to hang once in about ten
# starts here (every server up and answering): past this the run restarts with new servers.
CONNECT_S = 90.0
ANSWER_S = 5.0  # a server that does not answer for this long is away (stopped, restarting)
KEEPER_POLL_S = 0.5


class ServerLost(RuntimeError):
    """A parameter server ended, or a worker came back where its address is not: the run
    restarts from its newest checkpoint (Ray Train's restart of the coordinator)."""


class ServersUnreachable(RuntimeError):
    """The coordinator did not connect to its servers: a restart starts new ones."""


class NoRoomForServers(RuntimeError):
    retry = False  # a restart would ask for the same room


@ray.remote(max_task_retries=0)
class TFServer:
    """One ``tf.distribute.Server``: ``reserve()`` holds a free port on this node, ``start()``
    starts the server there (again on a restarted actor: same address, answered with its pid)."""

    def __init__(self):
        self._hold: PortHold | None = None
        self._server = None

    def reserve(self) -> str:
        self._hold = PortHold(0, host="0.0.0.0")  # TensorFlow's server listens on all of them
        return f"{ray.util.get_node_ip_address()}:{self._hold.port}"

    def start(self, spec: dict, job: str, index: int) -> dict | None:
        """Start this task's server; None where it runs already. A restarted actor on another
        node cannot take its address: it says where it is instead of starting."""
        if self._server is not None:
            return None
        address = spec[job][index]
        here = ray.util.get_node_ip_address()
        if address.rsplit(":", 1)[0] != here:
            return {"pid": os.getpid(), "elsewhere": here}
        if self._hold is not None:
            self._hold.release()
        import tensorflow as tf

        import trainers.tf_ps  # noqa: F401  (tf-keras before tensorflow)

        # A server runs one closure a worker at a time and more: fewer inter-op threads than
        # workers + 1 can deadlock it (TensorFlow's own advice).
        config = tf.compat.v1.ConfigProto(
            inter_op_parallelism_threads=len(spec["worker"]) + 1)
        self._server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=job,
                                            task_index=index, protocol="grpc", config=config,
                                            start=True)
        return {"pid": os.getpid()}

    def pid(self) -> int:
        return os.getpid()


@dataclass
class Member:
    """One server as the keeper sees it."""

    job: str  # "worker" or "ps"
    index: int
    actor: object
    address: str
    pid: int = 0
    restarts: int = 0
    away: list = field(default_factory=list)  # [{"from_step", "to_step", "seconds"}]
    rescheduled: int = 0  # closures that failed on it and went to another worker
    away_since: tuple[float, int] | None = None  # (monotonic time, step) it went away
    pending: object = None  # the keeper's outstanding call to it
    sent_at: float = 0.0

    def facts(self) -> dict:
        return {"index": self.index, "address": self.address, "pid": self.pid,
                "restarts": self.restarts, "rescheduled": self.rescheduled,
                "away_s": round(sum(a["seconds"] for a in self.away), 2),
                "away": self.away[-10:], "here": self.away_since is None}


class ParameterServers:
    """P parameter servers and N workers (Ray actors of ``cpus`` each), a keeper thread that
    brings lost workers back at their address, and the strategy over them (``strategy``)."""

    def __init__(self, workers: int, ps: int, cpus: float = 0.1):
        self.step = 0  # the coordinator's newest step, for the record of time away
        self.lost: str | None = None
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._members: list[Member] = []
        # A worker's actor comes back after a loss; a parameter server's would come back
        # empty, so it does not: its loss restarts the run from a checkpoint.
        for job, count, restarts in (("worker", workers, -1), ("ps", ps, 0)):
            for index in range(count):
                actor = TFServer.options(num_cpus=cpus, max_restarts=restarts).remote()
                self._members.append(Member(job, index, actor, ""))
        asked = [m.actor.reserve.remote() for m in self._members]
        _, waiting = ray.wait(asked, num_returns=len(asked), timeout=PLACEMENT_S)
        if waiting:
            for member in self._members:
                ray.kill(member.actor, no_restart=True)
            raise NoRoomForServers(
                f"{len(waiting)} of {len(asked)} servers ({workers} workers, {ps} parameter "
                f"servers, {cpus:g} CPU each) found no room on the cluster in {PLACEMENT_S:g} s")
        addresses = ray.get(asked)
        for member, address in zip(self._members, addresses, strict=True):
            member.address = address
        self._chief = PortHold(0, host="0.0.0.0")
        self.spec = {"worker": [m.address for m in self._members if m.job == "worker"],
                     "ps": [m.address for m in self._members if m.job == "ps"],
                     "chief": [f"{ray.util.get_node_ip_address()}:{self._chief.port}"]}
        started = ray.get([m.actor.start.remote(self.spec, m.job, m.index)
                           for m in self._members])
        for member, answer in zip(self._members, started, strict=True):
            member.pid = answer["pid"]
        self._counter = ReschedulingCounter(self._members)
        self._keeper = threading.Thread(target=self._keep, name="ps-keeper", daemon=True)
        self._strategy = None

    @property
    def strategy(self):
        """The coordinator's ParameterServerStrategy over these servers (made once)."""
        if self._strategy is None:
            import tensorflow as tf

            import trainers.tf_ps  # noqa: F401  (tf-keras before tensorflow)

            self._chief.release()  # the strategy starts the coordinator's own server there
            resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
                tf.train.ClusterSpec(self.spec), task_type="chief", task_id=0, rpc_layer="grpc")
            made: dict = {}

            def connect() -> None:  # in a thread: a hung connection cannot be interrupted
                try:
                    made["strategy"] = tf.distribute.ParameterServerStrategy(resolver)
                except BaseException as exc:  # raised below, in the coordinator's thread
                    made["error"] = exc
            connecting = threading.Thread(target=connect, name="ps-connect", daemon=True)
            connecting.start()
            connecting.join(CONNECT_S)
            if connecting.is_alive():
                raise ServersUnreachable(
                    f"the coordinator did not connect to its {len(self._members)} servers in "
                    f"{CONNECT_S:g} s (TensorFlow's connection to the cluster hung): the run "
                    "restarts with new ones")
            if "error" in made:
                raise made["error"]
            self._strategy = made["strategy"]
            logging.getLogger("tensorflow").addFilter(self._counter)
            self._keeper.start()
        return self._strategy

    def __enter__(self) -> ParameterServers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._keeper.is_alive():
            self._keeper.join(timeout=ANSWER_S)
        logging.getLogger("tensorflow").removeFilter(self._counter)
        self._chief.release()
        for member in self._members:
            ray.kill(member.actor, no_restart=True)

    def why_lost(self, wait_s: float = 2 * ANSWER_S) -> str | None:
        """After TensorFlow raised: the lost server that explains it, once the keeper has
        looked (a parameter server's end reaches TensorFlow first); None if nothing was lost."""
        deadline = time.monotonic() + wait_s
        while self.lost is None and self._keeper.is_alive() and time.monotonic() < deadline:
            time.sleep(KEEPER_POLL_S / 5)
        return self.lost

    def changed(self) -> bool:
        """Something worth reporting happened since the last call (a server left or came back)."""
        changed = self._changed.is_set() or self._counter.seen.is_set()
        self._changed.clear()
        self._counter.seen.clear()
        return changed

    def facts(self) -> dict:
        """run.json's "processes": each server's address, pid, restarts and time away."""
        workers = [m for m in self._members if m.job == "worker"]
        ps = len(self._members) - len(workers)
        here = sum(m.away_since is None for m in workers)
        shown = (f"{here}{'' if here == len(workers) else f' of {len(workers)}'} "
                 f"worker{'s' if len(workers) != 1 else ''}, {ps} parameter "
                 f"server{'s' if ps != 1 else ''}")
        return {"kind": "parameter_servers", "shown": shown, "coordinator_pid": os.getpid(),
                "rescheduled_closures": sum(m.rescheduled for m in self._members),
                "workers": [m.facts() for m in self._members if m.job == "worker"],
                "ps": [m.facts() for m in self._members if m.job == "ps"]}

    # -- the keeper ------------------------------------------------------------------------
    def _keep(self) -> None:
        while not self._stop.wait(KEEPER_POLL_S):
            for member in self._members:
                self._look_at(member, time.monotonic())

    def _look_at(self, member: Member, now: float) -> None:
        if member.pending is None:
            member.pending = (member.actor.start.remote(self.spec, member.job, member.index)
                              if member.job == "worker" else member.actor.pid.remote())
            member.sent_at = now
        ready, _ = ray.wait([member.pending], timeout=0)
        if not ready:
            if now - member.sent_at > ANSWER_S:
                self._went_away(member, now)
            return
        try:
            answer = ray.get(member.pending, timeout=0)
        except (RayActorError, GetTimeoutError) as exc:
            member.pending = None
            self._went_away(member, now)
            if member.job == "ps" and isinstance(exc, ActorDiedError):
                self.lost = (f"parameter server {member.index} (pid {member.pid}, "
                             f"{member.address}) ended: its variables are gone")
            return
        member.pending = None
        if isinstance(answer, dict):  # a restarted worker, its server started again
            member.pid, member.restarts = answer["pid"], member.restarts + 1
            if "elsewhere" in answer:
                self.lost = (f"worker {member.index} came back on {answer['elsewhere']}, not at "
                             f"its address {member.address}")
        self._came_back(member, now)

    def _went_away(self, member: Member, now: float) -> None:
        if member.away_since is None:
            member.away_since = (now, self.step)
            self._changed.set()

    def _came_back(self, member: Member, now: float) -> None:
        if member.away_since is not None:
            since, step = member.away_since
            member.away.append({"from_step": step, "to_step": self.step,
                                "seconds": round(now - since, 2)})
            member.away_since = None
            self._changed.set()


class ReschedulingCounter(logging.Filter):
    """Counts the closures TensorFlow's coordinator gives to another worker after theirs
    failed: it logs "Worker /job:worker/replica:0/task:<i> failed with ..." once for each,
    then puts the closure back on its queue. The lines leave the console (run.json counts them)."""

    def __init__(self, members: list[Member]):
        super().__init__()
        self._workers = {f"/job:worker/replica:0/task:{m.index}": m
                         for m in members if m.job == "worker"}
        self.seen = threading.Event()

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Worker %s failed with") or not record.args:
            return True
        member = self._workers.get(str(record.args[0]))
        if member is not None:
            member.rescheduled += 1
            self.seen.set()
        return False
