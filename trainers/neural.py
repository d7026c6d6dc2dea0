"""What the two neural-network trainers (DDP, MWMS) share, framework-free: the config fields
of a global-batch training loop, the check of the model's import path, and the feature scaling."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import Any, ClassVar

import numpy as np

from orchestrator.config.rules import require
from orchestrator.config.schema import TrainerConfig
from orchestrator.errors import ConfigError


@dataclass
class NeuralNetConfig(TrainerConfig):
    OPTIMIZERS: ClassVar[tuple[str, ...]] = ("sgd", "adam")
    model: dict[str, Any] = field(default_factory=dict)  # _target_ plus its keyword arguments
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    batch_size: int = 64  # the global batch: the same whatever the number of workers
    epochs: int = 10
    max_steps: int | None = None  # stop earlier than epochs * steps_per_epoch

    def __post_init__(self) -> None:
        require(self.optimizer in self.OPTIMIZERS, "trainer.optimizer", self.optimizer,
                "one of " + ", ".join(self.OPTIMIZERS))
        require(self.lr > 0, "trainer.lr", self.lr, "a number > 0")
        require(self.batch_size >= 1, "trainer.batch_size", self.batch_size, "an integer >= 1")
        require(self.epochs >= 1, "trainer.epochs", self.epochs, "an integer >= 1")
        if self.max_steps is not None:
            require(self.max_steps >= 1, "trainer.max_steps", self.max_steps,
                    "null or an integer >= 1")
        require("_target_" in self.model, "trainer.model._target_", None,
                "the import path of the model class or builder function")


def check_model_target(cfg: Mapping[str, Any]) -> None:
    """The model's module must exist (checked without importing it: no framework here)."""
    if cfg["data"].get("task") not in (None, "classification"):
        raise ConfigError(f"data.task={cfg['data']['task']!r} is not allowed with this trainer: "
                          "classification")
    target = cfg["trainer"]["model"]["_target_"]
    module = target.rpartition(".")[0]
    try:
        found = bool(module) and find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        found = False
    if not found:
        raise ConfigError(f"trainer.model._target_={target!r}: no module {module!r} to import")


def standardize(train: np.ndarray, *others: np.ndarray) -> list[np.ndarray]:
    """Scale by the training rows' mean and spread; constant columns are left as they are."""
    mean, std = train.mean(0), train.std(0)
    std = np.where(std < 1e-6, 1.0, std).astype(np.float32)
    return [((x - mean) / std).astype(np.float32) for x in (train, *others)]


def total_steps(config: Mapping[str, Any], steps_per_epoch: int) -> int:
    total = int(config["epochs"]) * steps_per_epoch
    return min(total, int(config["max_steps"])) if config.get("max_steps") else total
