"""LightGBM's loop (the training function is trainers/lightgbm/train.py): one step is one
boosting round.

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
from orchestrator.worker_api import WorkerContext
from trainers.boosting import (
    after_round,
    boosting_error_line,
    held_out_names,
    native_stderr_silenced,
    num_classes_of,
    test_metrics,
    worker_rows,
)

PARAM_KEYS = ("num_leaves", "learning_rate", "max_depth", "min_data_in_leaf",
              "feature_fraction", "lambda_l2")


def default_objective(num_classes: int) -> str:
    if num_classes == 0:
        return "regression"
    return "binary" if num_classes == 2 else "multiclass"


def booster_params(config: Mapping[str, Any], num_classes: int, seed: int) -> dict[str, Any]:
    """num_classes 0: regression."""
    params = {k: config[k] for k in PARAM_KEYS}
    objective = config.get("objective") or default_objective(num_classes)
    params.update(objective=objective, seed=seed, deterministic=True, force_row_wise=True,
                  verbosity=-1)
    if objective in ("multiclass", "multiclassova", "softmax", "multiclass_ova", "ova", "ovr"):
        params["num_class"] = num_classes
    params.update(config.get("params") or {})
    return params


def check_config(cfg: Mapping[str, Any]) -> list[str] | None:
    """Let LightGBM itself judge the parameters, on a tiny problem, before Ray starts; the
    names of the metrics the run will report (its evaluation log says the training ones), or
    None when the data does not say how many classes it has."""
    config = cfg["trainer"]
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 2)), np.tile([0.0, 1.0], 20)
    known = num_classes_of(cfg["data"])
    classes = 2 if known is None else known
    logged: dict = {}
    try:
        with native_stderr_silenced():
            train_set = lgb.Dataset(x, label=y)
            lgb.train(booster_params(config, classes, 0), train_set, num_boost_round=1,
                      valid_sets=[train_set], valid_names=["train"],
                      callbacks=[lgb.record_evaluation(logged)])
    except lgb.basic.LightGBMError as exc:
        key = "trainer.objective" if config.get("objective") else "trainer.params"
        raise ConfigError(f"{key}: LightGBM refuses it: {boosting_error_line(exc)}") from exc
    if known is None:  # the metrics depend on the classes (test_auc for two)
        return None
    return held_out_names(classes) + [f"train_{name}" for name in logged.get("train", {})]


def main(ctx: WorkerContext, cfg: dict) -> dict[str, float] | None:
    tcfg, data = cfg["trainer"], ctx.dataset()
    rows = worker_rows(len(data.y_train), ctx.rank, ctx.world_size)
    threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    params = booster_params(tcfg, data.num_classes, ctx.seed) | {"num_threads": threads}
    if ctx.world_size > 1:
        params.update(ray.train.lightgbm.get_network_params(), tree_learner="data_parallel",
                      pre_partition=True)
    booster = None
    if (path := ctx.restore(["model.txt"])) is not None:
        booster = lgb.Booster(model_file=str(path / "model.txt"))
    ctx.total_steps = int(tcfg["num_boost_round"])

    def evaluate(model: lgb.Booster) -> dict[str, float]:
        return test_metrics(np.asarray(model.predict(data.x_test)), data.y_test, data.num_classes)

    def each_round(env) -> None:
        metrics = {f"train_{name}": float(value) for _, name, value, _ in env.evaluation_result_list}
        if after_round(ctx, env.iteration + 1, metrics, len(data.y_train),
                       lambda: evaluate(env.model),
                       lambda folder: env.model.save_model(str(folder / "model.txt"))):
            raise lgb.callback.EarlyStopException(env.iteration, env.evaluation_result_list)

    if ctx.start_step < ctx.total_steps:
        train_set = lgb.Dataset(data.x_train[rows], label=data.y_train[rows], free_raw_data=False)
        booster = lgb.train(params, train_set, num_boost_round=ctx.total_steps - ctx.start_step,
                            init_model=booster, valid_sets=[train_set], valid_names=["train"],
                            callbacks=[each_round])
    return None if ctx.should_preempt() else evaluate(booster)
