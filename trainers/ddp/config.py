"""The DDP trainer's config; no torch import, so the driver can validate it cheaply."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainers.neural import NeuralNetConfig


@dataclass
class DDPConfig(NeuralNetConfig):
    OPTIMIZERS = ("sgd", "adam", "adamw")
    name: str = "ddp"
    fn: str = "trainers.ddp.train:main"
    backend: str = "torch"  # torch (nccl with GPUs, else gloo) | gloo | nccl
    # Any torch.nn.Module class or factory; it is called with in_features and num_classes.
    model: dict[str, Any] = field(
        default_factory=lambda: {"_target_": "trainers.ddp.models.MLP", "hidden": [128, 64]}
    )
    weight_decay: float = 0.0
