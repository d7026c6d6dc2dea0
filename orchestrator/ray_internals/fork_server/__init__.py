"""A sweep's worker processes, and a run's training workers, forked from a server that has
Ray, Ray Train and the workers' framework imported, instead of each started as a new Python.

A sweep runs its trials in one Ray job on one node, and every trial starts a recorder, Ray
Train's controller and its workers: four Pythons importing Ray (and the workers torch and Ray
Train's torch side), ~2 CPU-s each of the ~12 a trial takes on 2 cores
(docs/benchmarks.md). The raylet starts the job's worker processes with the job's runtime
environment's ``py_executable``, here client.py, which hands the start over to this job's
server: the server forks a child that runs Ray's worker in the client's arguments,
environment, folder and standard streams, with those modules already imported. The first
processes (before the server is up) start as Ray would start them: the client finds no
server and becomes the worker itself.

One server serves one job on one node (Ray's C++ config reads the job's id once, at
import): a sweep on an embedded cluster runs all its processes through it (the job's
``py_executable``); a plain run of a fixed size, on a cluster whose every node is on this
machine, runs its training workers through it (their actors' ``py_executable``, ray_session.py),
and a worker another node's raylet starts is turned away (server.py) and starts as Ray starts
it. The driver starts the server once Ray is up and stops it with the session. GPU runs do not
fork (a framework imported before Ray places a worker would see every GPU), nor elastic ones
(nodes of other machines join them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

CLIENT = Path(__file__).with_name("client.py")
SERVER = Path(__file__).with_name("server.py")
PARENT = "ORCHESTRATOR_FORK_PARENT"  # the driver's pid: the server ends if it is gone
# What every trial's processes import besides the workers' framework: Ray Train and Ray Data
# (their actor classes' IDs drawn apart from Ray's generator, server.py), Ray Train's
# controller with the orchestrator's side of it, the recorder (and its TensorBoard writer), the
# workers' training function, and the libraries Ray Train checks for at import.
PRELOAD = ("pandas", "pyarrow", "fsspec", "requests", "tensorboard.compat.proto.event_pb2",
           "tensorboard.summary.writer.record_writer", "ray.train", "ray.data",
           "ray.train.v2._internal.execution.controller", "orchestrator.driver.recorder",
           "orchestrator.ray_internals.controller_barrier", "orchestrator.worker.start")


def usable() -> bool:
    """Nothing else decides how the job's processes start: Ray's `py_executable` for a driver
    run by `uv run` (its workers run through uv), a runtime environment hook or a worker setup
    hook of the user's (the forked workers' thread pools follow ours), the raylet killing the
    children of a worker (a client's child is its worker); and a Ray or torch outside the
    tested range (versions.py)."""
    from orchestrator.ray_internals.knobs import SETUP_HOOK
    from orchestrator.ray_internals.versions import speed_hooks

    if not speed_hooks("fork_server") or os.environ.get("RAY_RUNTIME_ENV_HOOK") or os.environ.get(SETUP_HOOK) or \
            os.environ.get("RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper",
                           "").lower() in ("1", "true"):
        return False
    try:
        from ray._private.runtime_env.uv_runtime_env_hook import _get_uv_run_cmdline

        return _get_uv_run_cmdline() is None
    except Exception:  # noqa: BLE001  (moved in a Ray upgrade: no forks, to be safe)
        return False


@contextmanager
def socket_dir(wanted: bool) -> Iterator[str | None]:
    """Where the server will listen (None when not ``wanted``): a folder only this user can
    enter (the clients hand the server their environment, credentials included), removed
    after the block."""
    if not wanted:
        yield None
        return
    folder = tempfile.mkdtemp(prefix="orchestrator-fork-")
    try:
        yield os.path.join(folder, "server.sock")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def client_executable(path: str) -> str:
    """The job's runtime environment's ``py_executable`` (Ray puts it unquoted in a shell
    command: quoted here)."""
    return shlex.join([sys.executable, "-I", "-S", str(CLIENT), path])


def raylets_here(sockets: set[str]) -> dict[str, int]:
    """The pids of the raylets of these socket names that run on this machine, from /proc."""
    marks = {f"--raylet_socket_name={name}".encode(): name for name in sockets}
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                cmdline = (entry / "cmdline").read_bytes()
                found.update({marks[m]: int(entry.name) for m in marks if m in cmdline})
        except OSError:
            continue
        if len(found) == len(marks):
            break
    return found


def every_node_here() -> bool:
    """Every alive node of the cluster has its raylet on this machine (a test cluster's
    `ray start` nodes, an embedded head): a worker of another machine would be started with
    this machine's interpreter and client path, which it may not have. A node's own server
    serves only its own raylet's workers (server.py: same_node_and_job)."""
    import ray

    sockets = {n["RayletSocketName"] for n in ray.nodes() if n.get("Alive")}
    return len(raylets_here(sockets)) == len(sockets)


def raylet_pid() -> int:
    """The pid of this node's raylet (the one this driver is connected to), from /proc."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    name = next(n["RayletSocketName"] for n in ray.nodes() if n["NodeID"] == here)
    pid = raylets_here({name}).get(name)
    if pid is None:
        raise LookupError(f"no raylet with socket {name}")
    return pid


def start_server(path: str, modules: tuple[str, ...], job_env: dict[str, str]) \
        -> subprocess.Popen | None:
    """The server for this driver's job on this (the embedded head's) node, importing
    ``modules`` after PRELOAD in the job's environment (``job_env``: its runtime environment's
    variables, which modules such as Ray Data's read as they import); None where it cannot
    start (the trials' processes then start as Ray starts them)."""
    try:
        import ray

        env = {**os.environ, **job_env, "RAY_JOB_ID": ray.get_runtime_context().get_job_id(),
               "RAY_RAYLET_PID": str(raylet_pid()), PARENT: str(os.getpid())}
        # -P: the command's folder is not on its path (a user's requests.py would shadow the
        # library's in every child).
        return subprocess.Popen([sys.executable, "-P", str(SERVER), path, *PRELOAD, *modules],
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                # Not in the terminal's process group: a Ctrl-C is the sweep's
                                # to handle (Tune stops the trials), not a signal to the server.
                                start_new_session=True)
    except Exception as exc:  # noqa: BLE001  (a speed-up only)
        log.debug("no fork server: %s", exc)
        return None


@contextmanager
def serving(path: str | None, modules: tuple[str, ...], job_env: dict[str, str] | None = None) \
        -> Iterator[subprocess.Popen | None]:
    """A server at ``path`` (None: none) for the block, Ray up (the job's id is its)."""
    server = start_server(path, modules, job_env or {}) if path else None
    try:
        yield server
    finally:
        if server is not None:
            server.kill()
            server.wait()
        if path:
            for leftover in (path, path + ".tmp"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)
