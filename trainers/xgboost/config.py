"""The XGBoost trainer's config; no xgboost import here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.config.rules import require
from orchestrator.config.schema import TrainerConfig


@dataclass
class XGBoostConfig(TrainerConfig):
    name: str = "xgboost"
    fn: str = "trainers.xgboost.train:main"
    backend: str = "xgboost"
    objective: str | None = None  # null: binary:logistic or multi:softprob, from the data
    num_boost_round: int = 50  # a step is one boosting round
    max_depth: int = 6
    eta: float = 0.3
    subsample: float = 1.0
    colsample_bytree: float = 1.0
    min_child_weight: float = 1.0
    reg_lambda: float = 1.0
    tree_method: str = "hist"
    max_bin: int = 256
    params: dict[str, Any] = field(default_factory=dict)  # any other XGBoost parameter
    # Streamed data (data.stream): the quantised share in pages on the worker's local disk
    # (ExtMemQuantileDMatrix), for a share larger than memory.
    external_memory: bool = False

    def __post_init__(self) -> None:
        require(self.num_boost_round >= 1, "trainer.num_boost_round", self.num_boost_round,
                "an integer >= 1")
        require(self.max_depth >= 0, "trainer.max_depth", self.max_depth, "an integer >= 0")
        require(self.eta > 0, "trainer.eta", self.eta, "a number > 0")
        require(0 < self.subsample <= 1, "trainer.subsample", self.subsample, "a number in (0, 1]")
        require(0 < self.colsample_bytree <= 1, "trainer.colsample_bytree",
                self.colsample_bytree, "a number in (0, 1]")
