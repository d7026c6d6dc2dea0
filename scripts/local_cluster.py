"""A multi-node Ray cluster on this machine: a head and worker nodes started with `ray start`
on 127.0.0.1, each a real raylet that can be killed, drained (SIGTERM) or added.

Used by the test suite and scripts/chaos.py. Every process is stopped by its own pid.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.driver.processes import descendants, socket_folders
from orchestrator.ray_internals.knobs import connect_retry_env

RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    # Started from the project's environment, as an activated one: a job's `python` (ray job
    # submit's entrypoint runs in the node's environment) is the project's.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(connect_retry_env())  # a second less in every raylet's start
    env.update(extra or {})
    return env


@dataclass
class RayHead:
    address: str
    dashboard: str
    process: subprocess.Popen
    recorded_before: str | None = None  # CURRENT_CLUSTER's content before this head started


# `ray start --head` records its cluster here, and a plain `ray.init()` (or Ray Train's
# placement-group cleaner) on this machine then looks for that cluster: once the head is
# stopped, what was recorded before it must be put back.
CURRENT_CLUSTER = Path("/tmp/ray/ray_current_cluster")


def recorded_cluster() -> str | None:
    try:
        return CURRENT_CLUSTER.read_text()
    except FileNotFoundError:
        return None


def stop_cluster(head: RayHead) -> None:
    """Stop a head started by start_head, and leave CURRENT_CLUSTER as it was before it (if
    it still names this head: a newer cluster's record is not ours to touch)."""
    stop_head(head.process)
    # Ray records the GCS under the machine's own address (192.0.2.2:port) even for a head
    # started on 127.0.0.1: the port, unique on this machine, tells it is this head.
    if (recorded_cluster() or "").strip().rpartition(":")[2] == head.address.rpartition(":")[2]:
        before = head.recorded_before
        if before and answers(before.strip()):
            CURRENT_CLUSTER.write_text(before)
        else:  # nothing recorded before, or a cluster gone since: no stale record is left
            CURRENT_CLUSTER.unlink(missing_ok=True)


def answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


# The head's node health check, in Ray's own names (RAY_<name> in the GCS's environment). A
# SIGKILLed node refuses the check at once, so it is dead after period x threshold: 15 s with
# Ray's defaults (3000 ms x 5), during which an elastic job sizes its new group by a view that
# still counts the dead node's CPUs. Nothing a test checks depends on that wait.
HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "5"}
# No log monitor on these nodes: it streams workers' output to a driver that asks for it
# (log_to_driver, which a command asks for only with log.ray_verbose=true, on the Ray it starts
# itself), and otherwise only tails files: ~0.8 CPU-s every 30 s a node, ~4% of a suite run.
NO_LOG_MONITOR = ["--include-log-monitor=false"]
# No idle workers started for a cluster's first job (Ray starts one a CPU on every node, each
# importing Ray: ~1.5 CPU-s): the orchestrator's actors start in processes of their own runtime
# environment, never in those. Nodes take the head's system config.
NO_FIRST_JOB_PRESTART = ['--system-config={"prestart_worker_first_driver": false}']


def start_head(tmp: Path, num_cpus: int = 2, attempts: int = 3) -> RayHead:
    """A head on free ports (its dashboard agent's too: another Ray on the machine holds
    52365). On a loaded machine its raylet can miss Ray's 30 s registration window: again."""
    before = recorded_cluster()
    for attempt in range(1, attempts + 1):
        port, dash = free_port(), free_port()
        log_path = tmp / f"ray-head-{time.time_ns()}.log"
        proc = subprocess.Popen(
            [RAY, "start", "--head", "--block", f"--port={port}", f"--num-cpus={num_cpus}",
             "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={free_port()}",
             "--disable-usage-stats", *NO_LOG_MONITOR, *NO_FIRST_JOB_PRESTART],
            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env={**node_env(), **HEALTH},
            start_new_session=True,
        )
        if came_up(proc, log_path, 150):
            return RayHead(f"127.0.0.1:{port}", f"http://127.0.0.1:{dash}", proc, before)
        stop_head(proc)
        if attempt == attempts:
            raise RuntimeError(f"ray start --head failed: {log_path.read_text()[-2000:]}")
    raise AssertionError("unreachable")


def came_up(proc: subprocess.Popen, log_path: Path, timeout_s: float) -> bool:
    """Whether `ray start --block` said it is up before it exited or the time ran out."""
    deadline = time.time() + timeout_s
    while "block forever" not in log_path.read_text():
        if proc.poll() is not None or time.time() > deadline:
            return False
        time.sleep(0.5)
    return True


def node_env() -> dict:
    """`ray start --address` must use token auth exactly when the head does: the head turns it
    on when ~/.ray/auth_token exists, a joining node (Ray 2.60) does not by itself."""
    token = Path.home() / ".ray" / "auth_token"
    return clean_env({"RAY_AUTH_MODE": "token"} if token.exists() else {})


def add_node(head: RayHead, tmp: Path, num_cpus: int = 2, attempts: int = 3,
             env: dict | None = None, resources: dict | None = None) -> subprocess.Popen:
    """A worker node (its own raylet) joining the head; stop it like the head. On a loaded
    machine a raylet can miss its 30 s registration window (hard-coded in Ray 2.60): try again.
    ``env``: the node's own settings (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, say)."""
    for attempt in range(1, attempts + 1):
        log_path = tmp / f"ray-node-{time.time_ns()}.log"
        proc = subprocess.Popen(
            [RAY, "start", "--block", f"--address={head.address}", f"--num-cpus={num_cpus}",
             "--node-ip-address=127.0.0.1", "--disable-usage-stats",
             f"--dashboard-agent-listen-port={free_port()}", *NO_LOG_MONITOR,
             *([f"--resources={json.dumps(resources)}"] if resources else [])],
            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env={**node_env(), **(env or {})},
            start_new_session=True,
        )
        if came_up(proc, log_path, 150):
            return proc
        stop_head(proc)
        if attempt == attempts:
            raise RuntimeError(f"ray start --address failed: {log_path.read_text()[-2000:]}")
    raise AssertionError("unreachable")


def node_of(worker: dict, nodes: list[subprocess.Popen]) -> subprocess.Popen | None:
    """The `ray start` node a worker of a run record (its "node": Ray's node id) runs on: the
    node whose session (each node runs in one of its own, its pid the session id) holds the
    raylet started with that id. (Not the worker's own session: a worker the fork server
    forked has a session of its own.)"""
    mark = f"--node_id={worker['node']}".encode()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if mark in (entry / "cmdline").read_bytes().split(b"\0"):
                session = os.getsid(int(entry.name))
                return next((n for n in nodes if n.pid == session), None)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return None


def stop_head(proc: subprocess.Popen) -> None:
    """SIGTERM makes `ray start --block` stop every process it started; ours only."""
    stop_nodes([proc])


GRACE_S = 3


def stop_nodes(procs: list[subprocess.Popen]) -> None:
    """Stop `ray start` nodes all at once (each takes seconds to drain and shut down)."""
    running = [p for p in procs if p.poll() is None]
    # Their dashboards' forkserver sockets' folders, which a stopped dashboard leaves.
    sockets = socket_folders([d for p in running for d in [(p.pid, 0), *descendants(p.pid)]])
    for proc in running:
        proc.send_signal(signal.SIGTERM)
    # A node that ran jobs waits ~30 s for its idle workers before it exits; a test cluster
    # has nothing to keep, so after GRACE_S its whole process group (raylet, GCS, workers:
    # `ray start` ran in a session of its own) is killed.
    deadline = time.time() + GRACE_S
    for proc in running:
        try:
            proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    for proc in running:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    for folder in sockets:
        shutil.rmtree(folder, ignore_errors=True)
