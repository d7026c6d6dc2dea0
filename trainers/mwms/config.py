"""The MWMS trainer's config; no tensorflow import here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainers.neural import NeuralNetConfig


@dataclass
class MWMSConfig(NeuralNetConfig):
    name: str = "mwms"
    fn: str = "trainers.mwms.train:main"
    backend: str = "tensorflow"
    # A function (in_features, num_classes, **kwargs) -> tf.keras.Model returning logits.
    model: dict[str, Any] = field(
        default_factory=lambda: {"_target_": "trainers.mwms.models.mlp", "hidden": [128, 64]}
    )
