"""What a training worker's process imports as soon as it starts (Ray's
worker_process_setup_hook, set on the workers' runtime environment only, knobs.SETUP_HOOK): its backend's
framework (Backend.warm_imports). In a process kept ready for a restart
(orchestrator/worker/spare.py) that import is done before the failure, not after it: ~1 s of
torch off every recovery here. In a run's first workers it is the import the backend's setup
would do a moment later. Not on GPU workers: a process imports before Ray says which GPUs it
gets, and a framework that started CUDA then would see them all. No framework named here: the
driver passes the names.
"""

from __future__ import annotations

import importlib
import logging
import math
import os

from orchestrator.ray_internals.knobs import SETUP_HOOK

WARM_IMPORTS = "ORCHESTRATOR_WARM_IMPORTS"  # comma-separated module names
HOOK = "orchestrator.worker.warm.import_modules"

log = logging.getLogger(__name__)


def import_modules() -> None:
    for name in filter(None, os.environ.get(WARM_IMPORTS, "").split(",")):
        try:
            importlib.import_module(name)
        except Exception as exc:  # never the worker's failure: its own import says it clearly
            log.warning("could not import %s ahead: %s", name, exc)


def worker_runtime_env(env_vars: dict[str, str], modules: tuple[str, ...],
                       cpus_per_worker: float) -> dict:
    """The training workers' runtime environment: their variables, and the hook if there is
    anything to import ahead. Then OMP_NUM_THREADS is set here, as Ray sets it for a worker
    placed with ``cpus_per_worker`` CPUs (max(floor(cpus), 1)): Ray sets it only once the
    worker is placed, after the import, and torch's thread pool takes its size from the value
    it finds at import (measured: 3.8k against 29k samples/s on 2 cores, two threads a worker
    where each has one CPU). The driver's own value wins, as a user's on the cluster would."""
    if not modules:
        return {"env_vars": env_vars}
    threads = os.environ.get("OMP_NUM_THREADS", str(max(math.floor(cpus_per_worker), 1)))
    return {"env_vars": {"OMP_NUM_THREADS": threads, **env_vars,
                         WARM_IMPORTS: ",".join(modules), SETUP_HOOK: HOOK}}
