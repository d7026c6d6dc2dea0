"""Ray Train's TensorFlow backend without TensorFlow in the driver's and the controller's
processes.

Ray's own config (ray.train.tensorflow.TensorflowConfig) lives in a package that imports
tensorflow at its top: the driver building the config and Ray Train's controller unpickling it
each paid TensorFlow's import (~2 s of CPU here, measured with `python -X importtime`) for a
config with no field, and the driver's import wrote TensorFlow's absl lines ("oneDNN custom
operations are on", "Could not find cuda drivers") on the command's stderr, which
TF_CPP_MIN_LOG_LEVEL does not silence. This config does what Ray's _TensorflowBackend does
(each worker's address, then TF_CONFIG on every worker), and the work on the workers is Ray's
own function, imported there (where the trainer imports TensorFlow anyway).

tests/test_ray_internals.py checks the function used here against the installed Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray._common.network_utils import build_address
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig
from ray.train.v2._internal.util import TrainingFramework


@dataclass
class MultiWorkerConfig(BackendConfig):
    @property
    def backend_cls(self):
        return MultiWorkerSetup

    @property
    def framework(self):
        return TrainingFramework.TENSORFLOW

    def to_dict(self) -> dict:  # as Ray's TensorflowConfig shows itself on the dashboard
        return {}


class MultiWorkerSetup(Backend):
    def on_start(self, worker_group, backend_config: MultiWorkerConfig) -> None:
        addresses = worker_group.execute(_address)
        ray.get([worker_group.execute_single_async(rank, _tf_config, worker_addresses=addresses,
                                                   index=rank)
                 for rank in range(len(worker_group))])


# On the workers: Ray's own function, whose package imports tensorflow.

def _address() -> str:
    address, port = get_address_and_port()
    return build_address(address, port)


def _tf_config(**kwargs) -> None:
    from ray.train.tensorflow.config import _setup_tensorflow_environment

    _setup_tensorflow_environment(**kwargs)
