"""The DDP trainer's config; no torch import, so the driver can validate it cheaply."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.config.schema import require

OPTIMIZERS = ("sgd", "adam", "adamw")


@dataclass
class DDPConfig:
    _target_: str = "trainers.ddp.trainer.DDPTrainer"
    name: str = "ddp"
    # Any torch.nn.Module class or factory; it is called with in_features and num_classes.
    model: dict[str, Any] = field(
        default_factory=lambda: {"_target_": "trainers.ddp.models.MLP", "hidden": [128, 64]}
    )
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0
    batch_size: int = 64  # the global batch: the same whatever the number of workers
    epochs: int = 10
    max_steps: int | None = None  # stop earlier than epochs * steps_per_epoch
    backend: str = "auto"  # auto (nccl with GPUs, else gloo) | gloo | nccl

    def __post_init__(self) -> None:
        require(self.optimizer in OPTIMIZERS, "trainer.optimizer", self.optimizer,
                "one of " + ", ".join(OPTIMIZERS))
        require(self.lr > 0, "trainer.lr", self.lr, "a number > 0")
        require(self.batch_size >= 1, "trainer.batch_size", self.batch_size, "an integer >= 1")
        require(self.epochs >= 1, "trainer.epochs", self.epochs, "an integer >= 1")
        if self.max_steps is not None:
            require(self.max_steps >= 1, "trainer.max_steps", self.max_steps,
                    "null or an integer >= 1")
        require(self.backend in ("auto", "gloo", "nccl"), "trainer.backend", self.backend,
                "one of auto, gloo, nccl")
        require("_target_" in self.model, "trainer.model._target_", None,
                "the import path of a torch.nn.Module class or factory")
