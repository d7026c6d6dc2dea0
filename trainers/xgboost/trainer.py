"""XGBoost behind the Trainer interface: one step is one boosting round.

Each worker trains on its shard; Ray Train's XGBoost backend wraps the loop in xgboost's
collective context, so histograms are all-reduced and every worker holds the same booster.
A resume continues boosting from the saved booster (round r), not from zero.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import ray.train.xgboost
import xgboost as xgb

from orchestrator.errors import ConfigError
from orchestrator.trainer_api import Trainer
from trainers.boosting import (
    classification_metrics,
    first_line,
    native_stderr_silenced,
    worker_rows,
)

PARAM_KEYS = ("max_depth", "eta", "subsample", "colsample_bytree", "min_child_weight",
              "reg_lambda", "tree_method", "max_bin")


def booster_params(config: Mapping[str, Any], num_classes: int, seed: int) -> dict[str, Any]:
    params = {k: config[k] for k in PARAM_KEYS}
    objective = config.get("objective") or ("binary:logistic" if num_classes == 2 else "multi:softprob")
    params.update(objective=objective, seed=seed)
    if objective.startswith("multi:"):
        params["num_class"] = num_classes
    params.update(config.get("params") or {})
    return params


class _StepReporter(xgb.callback.TrainingCallback):
    def __init__(self, trainer: XGBoostTrainer):
        self.trainer = trainer

    def after_iteration(self, model, epoch, evals_log) -> bool:
        self.trainer.booster = model
        metrics = {f"train_{name}": float(history[-1])
                   for name, history in evals_log.get("train", {}).items()}
        s = self.trainer.session
        s.step_done(model.num_boosted_rounds(), metrics, samples=self.trainer.global_rows)
        return False  # never stop early: the round count is part of the config


class XGBoostTrainer(Trainer):
    step_unit = "round"

    @classmethod
    def ray_trainer_class(cls) -> type:
        return ray.train.xgboost.XGBoostTrainer

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> None:
        """Let XGBoost itself judge the parameters, on a tiny problem, before Ray starts."""
        x = np.array([[0.0], [1.0], [0.0], [1.0]], dtype=np.float32)
        y = np.array([0, 1, 0, 1], dtype=np.float32)
        try:
            with native_stderr_silenced():
                xgb.train(booster_params(config, 2, 0), xgb.DMatrix(x, label=y), num_boost_round=1)
        except xgb.core.XGBoostError as exc:
            key = "trainer.objective" if config.get("objective") else "trainer.params"
            raise ConfigError(f"{key}: XGBoost refuses it: {first_line(exc)}") from exc

    def setup(self, data) -> int:
        s = self.session
        rows = worker_rows(len(data.y_train), s.rank, s.world_size)
        threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
        self.params = booster_params(self.config, data.num_classes, s.seed) | {"nthread": threads}
        self.dtrain = xgb.DMatrix(data.x_train[rows], label=data.y_train[rows])
        self.global_rows = len(data.y_train)
        self.x_test, self.y_test, self.num_classes = data.x_test, data.y_test, data.num_classes
        self.booster: xgb.Booster | None = None
        return int(self.config["num_boost_round"])

    def save(self) -> dict[str, bytes]:
        return {"model.ubj": bytes(self.booster.save_raw("ubj"))}

    def load(self, files: Mapping[str, bytes]) -> None:
        self.booster = xgb.Booster(params=self.params, model_file=bytearray(files["model.ubj"]))

    def train(self, start_step: int) -> None:
        self.booster = xgb.train(
            self.params, self.dtrain,
            num_boost_round=self.session.total_steps - start_step,
            evals=[(self.dtrain, "train")], verbose_eval=False,
            xgb_model=self.booster, callbacks=[_StepReporter(self)],
        )

    def evaluate(self) -> dict[str, float]:
        proba = self.booster.predict(xgb.DMatrix(self.x_test))
        return classification_metrics(proba, self.y_test, self.num_classes)
