"""What Ray Train sets up around a training function, by name (``trainer.backend``).

Each backend is one of Ray Train's BackendConfig classes (torch's and TensorFlow's: Ray's,
without the framework in the driver and the controller, orchestrator/ray_internals/
torch_backend.py and tensorflow_backend.py), named here by import path and
imported only when a run uses it: the core imports no framework (torch elastic registers its
rendezvous backends the same way).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from orchestrator.errors import ConfigError
from orchestrator.ray_internals.torch_imports import TORCH_FORK, TORCH_WARM


def no_options(hang_timeout_s: float, use_gpu: bool) -> dict:
    return {}


@dataclass(frozen=True)
class Backend:
    name: str
    config_class: str  # "module:Class" of Ray Train's BackendConfig for it
    options: Callable[[float, bool], dict] = no_options  # (hang timeout, GPUs?) -> its kwargs
    controller_env: Mapping[str, str] = field(default_factory=dict)  # read by Ray Train's controller
    worker_env: Mapping[str, str] = field(default_factory=dict)  # set before the first import
    # Imported by each worker's process as it starts (orchestrator/worker/warm.py)
    warm_imports: tuple[str, ...] = ()
    # Imported by a sweep's fork server (orchestrator/ray_internals/fork_server/): the
    # framework and Ray Train's side of it, nothing that starts threads at import.
    fork_imports: tuple[str, ...] = ()

    def ray_config(self, hang_timeout_s: float, use_gpu: bool):
        module, _, name = self.config_class.partition(":")
        return getattr(importlib.import_module(module), name)(**self.options(hang_timeout_s, use_gpu))


def torch_options(process_group: str | None):
    def options(hang_timeout_s: float, use_gpu: bool) -> dict:
        # A stuck peer fails the collective after the hang timeout, not torch's 30 minutes.
        return {"backend": process_group or ("nccl" if use_gpu else "gloo"),
                "timeout_s": int(hang_timeout_s)}

    return options


# Replacing a worker group first asks every worker to leave the torch process group and waits
# up to 30 s (Ray's default) for all of them: a hung worker never answers, and the workers are
# killed right after anyway. Healthy ones leave in milliseconds.
TORCH_CONTROLLER_ENV = {"TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S": "2"}
# Ray's TorchConfig, less the import of torch in the controller's process.
TORCH_CONFIG = "orchestrator.ray_internals.torch_backend:TorchProcessGroupConfig"
# Keras 3 fails under MultiWorkerMirroredStrategy; tf-keras (Keras 2) works, and must be chosen
# before tensorflow is first imported in the worker.
TF_WORKER_ENV = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
# Ray's TensorflowConfig, less the import of tensorflow in the driver's and the controller's
# processes.
TF_CONFIG = "orchestrator.ray_internals.tensorflow_backend:MultiWorkerConfig"

# Parameter-server training (trainers/tf_ps/): Ray Train runs only its coordinator, with no
# collective of its own; gRPC fails fast to a lost server instead of waiting for it (TF's own
# advice for the coordinator: a lost worker's closures then go to the others at once).
TF_PS_WORKER_ENV = {**TF_WORKER_ENV, "GRPC_FAIL_FAST": "use_caller"}

BACKENDS: dict[str, Backend] = {
    b.name: b for b in [
        Backend("torch", TORCH_CONFIG, torch_options(None), TORCH_CONTROLLER_ENV,
                warm_imports=TORCH_WARM, fork_imports=TORCH_FORK),
        Backend("gloo", TORCH_CONFIG, torch_options("gloo"), TORCH_CONTROLLER_ENV,
                warm_imports=TORCH_WARM, fork_imports=TORCH_FORK),
        Backend("nccl", TORCH_CONFIG, torch_options("nccl"), TORCH_CONTROLLER_ENV,
                warm_imports=TORCH_WARM, fork_imports=TORCH_FORK),
        Backend("tensorflow", TF_CONFIG, worker_env=TF_WORKER_ENV),
        Backend("tensorflow_ps", "ray.train.backend:BackendConfig", worker_env=TF_PS_WORKER_ENV),
        Backend("xgboost", "ray.train.xgboost:XGBoostConfig"),
        Backend("lightgbm", "ray.train.lightgbm:LightGBMConfig"),
        Backend("none", "ray.train.backend:BackendConfig"),
    ]
}


def check_cluster(backend: Backend, gpus_per_worker: float) -> None:
    """nccl wants a whole GPU per rank: two ranks on one GPU fail after start-up with NCCL's
    "Duplicate GPU detected" (measured on an H100). Said before Ray starts instead."""
    nccl = backend.name == "nccl" or (backend.name == "torch" and gpus_per_worker > 0)
    if backend.name == "nccl" and gpus_per_worker == 0:
        raise ConfigError("trainer.backend='nccl' needs GPUs: set cluster.gpus_per_worker=1, or "
                          "trainer.backend=torch (gloo on CPU)")
    if nccl and gpus_per_worker != int(gpus_per_worker):
        raise ConfigError(
            f"cluster.gpus_per_worker={gpus_per_worker} is not allowed with nccl (trainer.backend="
            f"{backend.name} on GPUs): whole GPUs per worker (1, 2...); to share a GPU between "
            "workers use trainer.backend=gloo")


def backend_named(name: str) -> Backend:
    if name not in BACKENDS:
        raise ConfigError(f"trainer.backend={name!r} is not allowed: one of {', '.join(BACKENDS)} "
                          "(torch picks nccl with GPUs, else gloo)")
    return BACKENDS[name]
