"""The DDP trainer's config; no torch import, so the driver can validate it cheaply."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.config.schema import require
from trainers.neural import NeuralNetConfig


@dataclass
class DDPConfig(NeuralNetConfig):
    OPTIMIZERS = ("sgd", "adam", "adamw")
    _target_: str = "trainers.ddp.trainer.DDPTrainer"
    name: str = "ddp"
    # Any torch.nn.Module class or factory; it is called with in_features and num_classes.
    model: dict[str, Any] = field(
        default_factory=lambda: {"_target_": "trainers.ddp.models.MLP", "hidden": [128, 64]}
    )
    weight_decay: float = 0.0
    backend: str = "auto"  # auto (nccl with GPUs, else gloo) | gloo | nccl

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.backend in ("auto", "gloo", "nccl"), "trainer.backend", self.backend,
                "one of auto, gloo, nccl")
