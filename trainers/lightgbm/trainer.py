"""LightGBM behind the Trainer interface: one step is one boosting round.

Workers hold pre-partitioned shards and train with tree_learner=data_parallel over the
network Ray Train sets up; every worker ends each round with the same model. A resume
continues from the saved model (init_model), not from zero.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import lightgbm as lgb
import numpy as np
import ray.train.lightgbm

from orchestrator.errors import ConfigError
from orchestrator.trainer_api import Trainer
from trainers.boosting import (
    classification_metrics,
    first_line,
    native_stderr_silenced,
    worker_rows,
)

PARAM_KEYS = ("num_leaves", "learning_rate", "max_depth", "min_data_in_leaf",
              "feature_fraction", "lambda_l2")


def booster_params(config: Mapping[str, Any], num_classes: int, seed: int) -> dict[str, Any]:
    params = {k: config[k] for k in PARAM_KEYS}
    objective = config.get("objective") or ("binary" if num_classes == 2 else "multiclass")
    params.update(objective=objective, seed=seed, deterministic=True, force_row_wise=True,
                  verbosity=-1)
    if objective in ("multiclass", "multiclassova", "softmax", "multiclass_ova", "ova", "ovr"):
        params["num_class"] = num_classes
    params.update(config.get("params") or {})
    return params


class LightGBMTrainer(Trainer):
    step_unit = "round"

    @classmethod
    def ray_trainer_class(cls) -> type:
        return ray.train.lightgbm.LightGBMTrainer

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> None:
        """Let LightGBM itself judge the parameters, on a tiny problem, before Ray starts."""
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(40, 2)), np.tile([0.0, 1.0], 20)
        try:
            with native_stderr_silenced():
                lgb.train(booster_params(config, 2, 0), lgb.Dataset(x, label=y), num_boost_round=1)
        except lgb.basic.LightGBMError as exc:
            key = "trainer.objective" if config.get("objective") else "trainer.params"
            raise ConfigError(f"{key}: LightGBM refuses it: {first_line(exc)}") from exc

    def setup(self, data) -> int:
        s = self.session
        rows = worker_rows(len(data.y_train), s.rank, s.world_size)
        threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
        self.params = booster_params(self.config, data.num_classes, s.seed)
        self.params.update(num_threads=threads)
        if s.world_size > 1:
            self.params.update(ray.train.lightgbm.get_network_params(),
                               tree_learner="data_parallel", pre_partition=True)
        self.x_shard, self.y_shard = data.x_train[rows], data.y_train[rows]
        self.global_rows = len(data.y_train)
        self.x_test, self.y_test, self.num_classes = data.x_test, data.y_test, data.num_classes
        self.booster: lgb.Booster | None = None
        return int(self.config["num_boost_round"])

    def save(self) -> dict[str, bytes]:
        return {"model.txt": self.booster.model_to_string().encode()}

    def load(self, files: Mapping[str, bytes]) -> None:
        self.booster = lgb.Booster(model_str=files["model.txt"].decode())

    def _report(self, env) -> None:
        self.booster = env.model
        metrics = {f"train_{name}": float(value) for _, name, value, _ in env.evaluation_result_list}
        self.session.step_done(env.iteration + 1, metrics, samples=self.global_rows)

    def train(self, start_step: int) -> None:
        train_set = lgb.Dataset(self.x_shard, label=self.y_shard, free_raw_data=False)
        self.booster = lgb.train(
            self.params, train_set,
            num_boost_round=self.session.total_steps - start_step,
            init_model=self.booster, valid_sets=[train_set], valid_names=["train"],
            callbacks=[self._report],
        )

    def evaluate(self) -> dict[str, float]:
        proba = self.booster.predict(self.x_test)
        return classification_metrics(np.asarray(proba), self.y_test, self.num_classes)
