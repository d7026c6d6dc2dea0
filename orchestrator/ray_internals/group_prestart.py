"""A run's first worker group's processes started beside Ray Train's controller, not after it.

fit() starts Ray Train's controller (a process importing Ray and Ray Train: ~1.5 s on 2 cores),
which then asks for its worker group: one actor per worker (and a synchronization actor
where its barrier is not kept in the controller, controller_barrier.py), each a new process (the workers' setup hook imports the framework: ~3 s of wall time here,
orchestrator/worker/warm.py). As soon as the controller's process has started, the driver asks
this node's raylet for those processes itself (prestart.py), with the runtime environments Ray
will give them, as the raylet's startup slots allow (it starts at most its node's CPU count of
processes at a time and drops a prestart asked beyond that); the group's actors then start in
them, and their imports overlap the controller's.

The runtime environments must be Ray's to the byte (the raylet matches a process to an actor
by its serialized string): a worker's is its actor options' environment laid over the
controller's, the controller's its own over the job's, by Ray core's rule (``inherited``), and
the synchronization actor's the controller's as it is. tests/test_ray_internals.py checks them
against a real run's. Where one does not match, its process stays idle until
``KEEP_ALIVE_S`` and the run starts its own: a cost, not a failure.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from orchestrator.ray_internals.prestart import STARTING_MARK, prestart

log = logging.getLogger(__name__)

KEEP_ALIVE_S = 120  # a process asked for here and never taken is reaped after this
WAIT_S = 30.0  # for the controller's process to start, and the group's to be asked for
APPEAR_S = 0.2  # for a process asked for to show in /proc


def inherited(parent: str, child: dict) -> str:
    """The serialized runtime environment of an actor created with ``child`` (its options') by
    a process whose own is ``parent``: Ray core's override (core_worker.cc OverrideRuntimeEnv:
    the child's keys over the parent's, env_vars merged key by key) in its JSON library's
    compact dump with sorted keys. An empty ``child`` inherits ``parent`` as it is."""
    if not child:
        return parent
    merged = json.loads(parent) if parent else {}
    for key, value in child.items():
        if key == "env_vars" and isinstance(merged.get(key), dict) and isinstance(value, dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return json.dumps(merged, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def group_runtime_envs(job_env: str, worker_options_env: dict) -> tuple[str, str]:
    """What Ray Train 2.60 gives its controller, and so its synchronization actor (created
    with no environment of its own): its variables (DataParallelTrainer.
    _initialize_and_run_controller) over the job's; and its training workers: their own
    (WorkerGroup._get_worker_runtime_env) over the controller's."""
    from ray.train.v2._internal.constants import get_env_vars_to_propagate
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup
    from ray.train.v2.api import data_parallel_trainer as trainer

    controller_vars = get_env_vars_to_propagate()
    controller_vars.setdefault(trainer.RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
                               trainer.DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE)
    controller = inherited(job_env, {"env_vars": controller_vars})
    # The controller's process has its variables in its environment when it computes the
    # workers' (their propagated values are the same).
    return controller, inherited(controller,
                                 dict(WorkerGroup._get_worker_runtime_env(worker_options_env)))


def _processes() -> list[tuple[int, bytes, list[bytes]]]:
    """(pid, command line, environment) of this machine's processes that Ray could start."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            if any(var.startswith(b"RAY_JOB_ID=") for var in environ):
                found.append((int(entry.name), (entry / "cmdline").read_bytes(), environ))
        except OSError:
            continue
    return found


def job_processes(job_hex: bytes) -> set[int]:
    return {pid for pid, _, environ in _processes() if b"RAY_JOB_ID=" + job_hex in environ}


def starting() -> int:
    """Ray worker processes on this machine not yet registered with their raylet."""
    return sum(1 for _, line, _ in _processes() if STARTING_MARK in line)


def prestart_beside_controller(asks: list[tuple[str, int]], slots: int) -> threading.Thread:
    """In a thread: once the controller's process has started (the first of this job's
    processes started after this call), ask for each of ``asks``' count of processes of its
    runtime environment on this node, in order, each once fewer than ``slots`` processes are
    starting: the raylet starts no more at a time (its startup concurrency, its CPU count by
    default) and drops a prestart beyond."""
    import ray

    job_hex = ray._private.worker.global_worker.current_job_id.hex().encode()
    before = job_processes(job_hex)

    def run() -> None:
        deadline = time.monotonic() + WAIT_S
        while not job_processes(job_hex) - before:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.02)
        queue = [env for env, count in asks for _ in range(count)]
        while queue and time.monotonic() < deadline:
            free = slots - starting()
            if free <= 0:
                time.sleep(0.02)
                continue
            batch = queue[:free]
            for env in dict.fromkeys(batch):
                problem = prestart(env, batch.count(env), KEEP_ALIVE_S)
                if problem:
                    log.debug("no process started ahead: %s", problem)
                    return
            del queue[:len(batch)]
            time.sleep(APPEAR_S)  # the raylet counts them as starting before they show

    thread = threading.Thread(target=run, name="prestart-workers", daemon=True)
    thread.start()
    return thread
