"""The MWMS trainer's config; no tensorflow import here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.config.rules import require
from orchestrator.errors import ConfigError
from trainers.neural import NeuralNetConfig, check_model_target


@dataclass
class MWMSConfig(NeuralNetConfig):
    name: str = "mwms"
    fn: str = "trainers.mwms.train:main"
    backend: str = "tensorflow"
    # A function (in_features, num_classes, **kwargs) -> tf.keras.Model returning logits.
    model: dict[str, Any] = field(
        default_factory=lambda: {"_target_": "trainers.mwms.models.mlp", "hidden": [128, 64]}
    )
    allow_nonfinite_loss: bool = False  # a NaN/inf loss stops the run, naming the step

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.momentum <= 1, "trainer.momentum", self.momentum,
                "a number from 0 to 1 (tf-keras' SGD)")


def check_mwms(cfg: dict) -> None:
    """Before Ray: the model's builder and its keys (trainers/neural.py), and data MWMS reads."""
    if cfg["data"].get("name") == "torch":
        raise ConfigError("data=torch is not allowed with trainer=mwms: its data is tabular "
                          "(digits, synthetic, parquet); your own torch datasets train with "
                          "trainer=ddp or fsdp")
    check_model_target(cfg)
