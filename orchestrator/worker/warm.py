"""What a training worker's process imports as soon as it starts: its backend's framework
(Backend.warm_imports), through Ray's worker_process_setup_hook (knobs.SETUP_HOOK), set on the
workers' runtime environment only.

In a process kept ready for a restart (orchestrator/worker/spare.py) that import is done before
the failure, not after it: ~1 s of torch and ~0.8 s of its compiler front end
(orchestrator/ray_internals/torch_imports.py) off every recovery here. In a run's first workers
it is the import the backend's set-up and the first optimizer would do a moment later. Not on
GPU workers: a process imports before Ray says which GPUs it gets, and a framework that started
CUDA then would see them all. Not where the job has a setup hook of its own (`ray job submit`
with worker_process_setup_hook): one variable holds one hook, and the user's runs. No framework
named here: the driver passes the names, the backend's (Backend.warm_imports) or the training
function's own (``training_function(warm_imports=...)``); a name ``module:function`` calls the
function once the module is imported.

Before the import the hook sets OMP_NUM_THREADS as Ray would for the worker's CPUs (the
node's own value first, else max(floor(cpus), 1)): Ray sets it only once the worker is placed,
after the import, and torch sizes its thread pool at import (measured: 3.8k against 29k
samples/s on 2 cores, two threads a worker where each has one CPU).
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import os
from collections.abc import Iterable

from orchestrator.ray_internals.knobs import SETUP_HOOK

WARM_IMPORTS = "ORCHESTRATOR_WARM_IMPORTS"  # comma-separated module names
WORKER_CPUS = "ORCHESTRATOR_WORKER_CPUS"  # the CPUs each worker is placed with
HOOK = "orchestrator.worker.warm.import_modules"

log = logging.getLogger(__name__)


def import_modules() -> None:
    threads_for_cpus()
    import_ahead(filter(None, os.environ.get(WARM_IMPORTS, "").split(",")))


def threads_for_cpus() -> str | None:
    """OMP_NUM_THREADS as Ray would set it for this worker's CPUs (the node's own value first),
    set now; None where neither says."""
    cpus = os.environ.get(WORKER_CPUS)
    if cpus and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(math.floor(float(cpus)), 1))
    return os.environ.get("OMP_NUM_THREADS")


def import_ahead(names: Iterable[str]) -> None:
    """Import each module; ``module:attribute.path`` calls that attribute once imported."""
    for name in names:
        module, _, function = name.partition(":")
        try:
            imported = importlib.import_module(module)
            if function:
                functools.reduce(getattr, function.split("."), imported)()
        except Exception as exc:  # never the worker's failure: its own import says it clearly
            log.warning("could not import %s ahead: %s", name, exc)


def worker_runtime_env(env_vars: dict[str, str], modules: tuple[str, ...],
                       cpus_per_worker: float, py_executable: str | None = None) -> dict:
    """The training workers' runtime environment: their variables, the hook if there is
    anything to import ahead and the job has no hook of its own, and the fork server's client
    where they fork from one (orchestrator/ray_internals/fork_server/)."""
    forks = {"py_executable": py_executable} if py_executable else {}
    if not modules or SETUP_HOOK in os.environ:
        return {"env_vars": env_vars, **forks}
    return {"env_vars": {**env_vars, WARM_IMPORTS: ",".join(modules),
                         WORKER_CPUS: str(cpus_per_worker), SETUP_HOOK: HOOK}, **forks}
