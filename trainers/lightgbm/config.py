"""The LightGBM trainer's config; no lightgbm import here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.config.rules import require
from orchestrator.config.schema import TrainerConfig


@dataclass
class LightGBMConfig(TrainerConfig):
    name: str = "lightgbm"
    fn: str = "trainers.lightgbm.train:main"
    backend: str = "lightgbm"
    objective: str | None = None  # null: binary or multiclass, from the data
    num_boost_round: int = 50  # a step is one boosting round
    num_leaves: int = 31
    learning_rate: float = 0.1
    max_depth: int = -1
    min_data_in_leaf: int = 20
    feature_fraction: float = 1.0
    lambda_l2: float = 0.0
    params: dict[str, Any] = field(default_factory=dict)  # any other LightGBM parameter

    def __post_init__(self) -> None:
        require(self.num_boost_round >= 1, "trainer.num_boost_round", self.num_boost_round,
                "an integer >= 1")
        require(self.num_leaves >= 2, "trainer.num_leaves", self.num_leaves, "an integer >= 2")
        require(self.learning_rate > 0, "trainer.learning_rate", self.learning_rate, "a number > 0")
        require(0 < self.feature_fraction <= 1, "trainer.feature_fraction",
                self.feature_fraction, "a number in (0, 1]")
