"""Processes kept ready for a service's next command (orchestrator/service/): Ray's private
actor table and the raylet's PrestartWorkers call.

Each command starts its actors (the run's recorder, Ray Train's controller, the training
workers) in new processes: Python, Ray and the worker's
framework imported, ~5 of a warm command's ~9 s on 2 cores. A service's job outlives its
commands, so after each command it asks this node's raylet for idle processes like the ones
the command's actors ran in (their runtime environments, as the GCS actor table records them),
and the next command's actors start in those. What the command before left idle and this one
did not take is ended first: only the newest command's shape is kept ready. Checked against
the installed Ray by tests/test_service.py (every actor of the second command in a process
kept ready).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from pathlib import Path

from orchestrator.ray_internals.prestart import STARTING_MARK, prestart

log = logging.getLogger(__name__)

EXIT_WAIT_S = 10.0
START_WAIT_S = 60.0
IDLE_TITLE = b"ray::IDLE"  # what Ray names an idle worker process (setproctitle)
STALLED_S = 1.0  # none of the job's processes starting for this long: the raylet dropped one


def actors_started_since(since_s: float) -> list[dict]:
    """This job's actors of one run placed on this node that started at or after ``since_s``
    (epoch seconds): class name, serialized runtime environment, pid. Not named or detached
    actors: those outlive a run (Ray's AutoscalingCoordinator, on a joined cluster)."""
    import ray
    from ray._private import state
    from ray.core.generated import gcs_pb2

    worker = ray._private.worker.global_worker
    node = ray.get_runtime_context().get_node_id()
    table = state.state._connect_and_get_accessor().get_actor_table(worker.current_job_id, None)
    found = []
    for raw in table:
        actor = gcs_pb2.ActorTableData.FromString(raw)
        if actor.start_time / 1000 >= since_s and actor.node_id.hex() == node and \
                not actor.is_detached and not actor.name:
            found.append({"class": actor.class_name.rsplit(".", 1)[-1], "pid": actor.pid,
                          "runtime_env": actor.serialized_runtime_env})
    return found


def idle_processes() -> list[int]:
    """Pids of this job's idle worker processes on this machine (Ray sets RAY_JOB_ID in every
    worker's environment)."""
    return _job_processes(lambda cmdline: cmdline.startswith(IDLE_TITLE))


def starting_processes() -> list[int]:
    """Pids of this job's worker processes still starting (not yet registered with Ray)."""
    return _job_processes(lambda cmdline: STARTING_MARK in cmdline)


def _job_processes(chosen) -> list[int]:
    import ray

    job = ray._private.worker.global_worker.current_job_id.hex().encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not chosen((entry / "cmdline").read_bytes()):
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"RAY_JOB_ID=" + job in environ:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_exited(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until these processes have exited; the ones still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [pid for pid in pids if pid and alive(pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def end_run_actors(actors: list[dict], grace_s: float = 2.0) -> list[str]:
    """The run is over: its actors end with it, in a job that goes on (a service's). Ray ends
    an actor once no handle to it is left; one still referenced somewhere in this process (seen:
    the recorder and Ray Train's controller, through the run's own objects) is killed after
    ``grace_s``. Returns the classes killed."""
    gc.collect()  # handles held only by reference cycles
    left = set(wait_exited([a["pid"] for a in actors], grace_s))
    killed = []
    for actor in actors:
        if actor["pid"] in left:
            try:
                os.kill(actor["pid"], signal.SIGKILL)
                killed.append(actor["class"])
            except ProcessLookupError:
                pass
    return killed


def keep_ready_like(actors: list[dict], keep_alive_s: float, cancelled: threading.Event,
                    exit_wait_s: float = EXIT_WAIT_S, slots: int | None = None) -> str | None:
    """Once ``actors``' processes have exited, end this job's idle processes, then ask for one
    like each of ``actors``' processes, kept ``keep_alive_s``, until ``cancelled`` (the next
    command is here: it takes what is up). ``slots``: how many the raylet starts at once (its
    node's CPU count). Returns why not, or None (a speed-up only)."""
    # An actor's process still exiting counts as one of its kind to the raylet, which then
    # starts one fewer (seen: 1 of 2 workers ready, every other command).
    wait_exited([a["pid"] for a in actors], exit_wait_s)
    for pid in idle_processes():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    slots = slots or max(1, os.cpu_count() or 1)
    # Those of one environment together, as many at once as the raylet starts (it drops a
    # prestart asked beyond its startup slots), each batch awaited before the next: asked
    # before the last one was up, the raylet started one fewer about every other time. One
    # it started fewer is asked for again. The workers first: the slowest to start.
    kinds: dict[str, list[str]] = {}
    for actor in sorted(actors, key=lambda a: a["class"] != "RayTrainWorker"):
        kinds.setdefault(actor["runtime_env"], []).append(actor["class"])
    for runtime_env, classes in kinds.items():
        wanted = len(classes)
        while wanted > 0:
            if cancelled.is_set():
                return None
            before, asked = set(idle_processes()), min(wanted, slots)
            problem = prestart(runtime_env, asked, keep_alive_s)
            if problem:
                return problem
            deadline, stalled_since = time.monotonic() + START_WAIT_S, None
            while len(set(idle_processes()) - before) < asked and not cancelled.is_set():
                now = time.monotonic()
                if starting_processes():
                    stalled_since = None
                elif stalled_since is None:
                    stalled_since = now
                elif now - stalled_since >= STALLED_S:
                    break  # nothing more is coming: ask again for the rest
                if now >= deadline:
                    return f"a process for {classes[0]} did not start in {START_WAIT_S:.0f} s"
                time.sleep(0.05)
            came = len(set(idle_processes()) - before)
            if came == 0 and not cancelled.is_set():
                return f"the raylet started no process for {classes[0]}"
            wanted -= came
    return None
