"""Ray Train's torch backend without torch in the controller's process.

Ray's own config (ray.train.torch.TorchConfig) lives in a module that imports torch at its
top, and Ray Train's controller unpickles the config: every run's controller paid ~1.3 CPU-s
importing torch it never uses (measured: the controller's imports 1.1 CPU-s without it, 2.4
with it), on the path to the first step. This config does what Ray's _TorchBackend does for
CPU and GPU ranks (gloo or nccl, an env:// rendezvous at rank 0's address), and the work on
the workers is Ray's own functions, imported there. TPU backends are Ray's alone (the
orchestrator never asks for them).

tests/test_ray_internals.py checks the functions used here against the installed Ray.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import (
    DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
    TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
)
from ray.train.v2._internal.util import TrainingFramework

log = logging.getLogger(__name__)


@dataclass
class TorchProcessGroupConfig(BackendConfig):
    backend: str = "gloo"  # or nccl: decided on the driver (orchestrator/driver/backends.py)
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return TorchProcessGroup

    @property
    def train_func_context(self):
        return TorchDeviceContext

    @property
    def framework(self):
        return TrainingFramework.TORCH

    def to_dict(self) -> dict:  # as Ray's TorchConfig shows itself on the dashboard
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class TorchProcessGroup(Backend):
    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group, backend_config: TorchProcessGroupConfig) -> None:
        address, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(_rendezvous_at, address=address, port=port)
        worker_group.execute(_torch_distributed_env)  # LOCAL_RANK and the rest, as torchrun's
        ray.get([worker_group.execute_single_async(
            rank, _join_process_group, backend=backend_config.backend, world_rank=rank,
            world_size=len(worker_group), init_method="env://", timeout_s=backend_config.timeout_s)
            for rank in range(len(worker_group))])

    def on_shutdown(self, worker_group, backend_config) -> None:
        futures = worker_group.execute_async(_leave_process_group,
                                             destroy_process_group=len(worker_group) > 1)
        timeout_s = int(os.environ.get(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
                                       DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S))
        try:
            ray.get(futures, timeout=timeout_s)
        except GetTimeoutError:
            log.warning("Torch process group shutdown timed out after %s seconds", timeout_s)


# On the workers: Ray's own functions, whose module imports torch.

def _rendezvous_at(address: str, port: int) -> None:
    os.environ["MASTER_ADDR"] = address
    os.environ["MASTER_PORT"] = str(port)


def _torch_distributed_env() -> None:
    from ray.train.torch.config import _set_torch_distributed_env_vars

    _set_torch_distributed_env_vars()


def _join_process_group(**kwargs) -> None:
    from ray.train.torch.config import _setup_torch_process_group

    _setup_torch_process_group(**kwargs)


def _leave_process_group(destroy_process_group: bool) -> None:
    from ray.train.torch.config import _shutdown_torch

    _shutdown_torch(destroy_process_group=destroy_process_group)


class TorchDeviceContext:
    """Ray's context around the training function (it sets the rank's CUDA device)."""

    def __enter__(self):
        from ray.train.torch.config import TorchConfigContextManager

        self._context = TorchConfigContextManager()
        return self._context.__enter__()

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)
