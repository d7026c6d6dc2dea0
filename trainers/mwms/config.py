"""The MWMS trainer's config; no tensorflow import here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.config.schema import require

OPTIMIZERS = ("sgd", "adam")


@dataclass
class MWMSConfig:
    _target_: str = "trainers.mwms.trainer.MWMSTrainer"
    name: str = "mwms"
    # A function (in_features, num_classes, **kwargs) -> tf.keras.Model returning logits.
    model: dict[str, Any] = field(
        default_factory=lambda: {"_target_": "trainers.mwms.models.mlp", "hidden": [128, 64]}
    )
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    batch_size: int = 64  # the global batch: the same whatever the number of workers
    epochs: int = 10
    max_steps: int | None = None

    def __post_init__(self) -> None:
        require(self.optimizer in OPTIMIZERS, "trainer.optimizer", self.optimizer,
                "one of " + ", ".join(OPTIMIZERS))
        require(self.lr > 0, "trainer.lr", self.lr, "a number > 0")
        require(self.batch_size >= 1, "trainer.batch_size", self.batch_size, "an integer >= 1")
        require(self.epochs >= 1, "trainer.epochs", self.epochs, "an integer >= 1")
        if self.max_steps is not None:
            require(self.max_steps >= 1, "trainer.max_steps", self.max_steps,
                    "null or an integer >= 1")
        require("_target_" in self.model, "trainer.model._target_", None,
                "the import path of a function returning a tf.keras.Model")
