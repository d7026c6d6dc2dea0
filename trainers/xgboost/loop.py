"""XGBoost's loop (the training function is trainers/xgboost/train.py): one step is one
boosting round.

Each worker boosts on its shard; Ray Train's xgboost backend wraps the function in xgboost's
collective context, so histograms are all-reduced and every worker holds the same booster.
A resume continues boosting from the saved booster (round r), not from zero.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import xgboost as xgb

from orchestrator.errors import ConfigError
from orchestrator.worker_api import WorkerContext
from trainers.boosting import (
    after_round,
    boosting_error_line,
    check_params,
    check_probabilities,
    held_out_names,
    metric_sums,
    metrics_from_sums,
    native_stderr_silenced,
    no_sums,
    num_classes_of,
    test_metrics,
    tiny_problem,
    worker_rows,
)

PARAM_KEYS = ("max_depth", "eta", "subsample", "colsample_bytree", "min_child_weight",
              "reg_lambda", "tree_method", "max_bin")


# XGBoost's other names of the parameters the trainer sets, and of the round count.
XGBOOST_NAMES = {"eta": {"eta", "learning_rate"}, "reg_lambda": {"reg_lambda", "lambda"}}
XGBOOST_ROUNDS = {"num_boost_round", "n_estimators", "num_round", "num_rounds", "nrounds"}
XGBOOST_STOPPING = {"early_stopping_rounds", "early_stopping_round"}


def default_objective(num_classes: int) -> str:
    if num_classes == 0:
        return "reg:squarederror"
    return "binary:logistic" if num_classes == 2 else "multi:softprob"


def booster_params(config: Mapping[str, Any], num_classes: int, seed: int) -> dict[str, Any]:
    """num_classes 0: regression."""
    params = {k: config[k] for k in PARAM_KEYS}
    objective = config.get("objective") or default_objective(num_classes)
    params.update(objective=objective, seed=seed)
    if objective.startswith("multi:"):
        params["num_class"] = num_classes
    params.update(config.get("params") or {})
    return params


def check_config(cfg: Mapping[str, Any]) -> list[str] | None:
    """Let XGBoost itself judge the parameters, on a tiny problem, before Ray starts; the
    names of the metrics the run will report (its evaluation log says the training ones), or
    None when the data does not say how many classes it has."""
    config = cfg["trainer"]
    check_params(config.get("params"), XGBOOST_NAMES, XGBOOST_ROUNDS, XGBOOST_STOPPING, "XGBoost")
    known = num_classes_of(cfg["data"])
    classes = 2 if known is None else known
    x, y = tiny_problem(classes)
    logged: dict = {}
    params = booster_params(config, classes, 0)
    key = "trainer.objective" if config.get("objective") else "trainer.params"
    try:
        with native_stderr_silenced():
            matrix = xgb.DMatrix(x, label=y)
            model = xgb.train(params, matrix, num_boost_round=1, evals=[(matrix, "train")],
                              evals_result=logged, verbose_eval=False)
            prediction = model.predict(matrix)
    except xgb.core.XGBoostError as exc:
        raise ConfigError(f"{key}: XGBoost refuses it: {boosting_error_line(exc)}") from exc
    if classes:
        check_probabilities(prediction, classes, key, params["objective"])
    if known is None:  # the metrics depend on the classes (test_auc for two)
        return None
    return held_out_names(classes) + [f"train_{name}" for name in logged.get("train", {})]


class _EachRound(xgb.callback.TrainingCallback):
    def __init__(self, ctx: WorkerContext, samples: int, evaluate):
        self.ctx, self.samples, self.evaluate = ctx, samples, evaluate

    def after_iteration(self, model, epoch, evals_log) -> bool:
        metrics = {f"train_{name}": float(history[-1])
                   for name, history in evals_log.get("train", {}).items()}
        return after_round(self.ctx, model.num_boosted_rounds(), metrics, self.samples,
                           lambda: self.evaluate(model),
                           lambda folder: model.save_model(str(folder / "model.ubj")))


class ShareChunks(xgb.DataIter):
    """This rank's row groups, one at a time, for a QuantileDMatrix: the share is sketched
    and quantised chunk by chunk, never held whole as floats."""

    def __init__(self, share, cache: str | None = None):
        self.share, self._chunks = share, None
        super().__init__(cache_prefix=cache)

    def next(self, input_data) -> bool:
        if self._chunks is None:
            self._chunks = self.share.train_chunks()
        chunk = next(self._chunks, None)
        if chunk is None:
            return False
        input_data(data=chunk[0], label=chunk[1])
        return True

    def reset(self) -> None:
        self._chunks = None


class StreamedNeedsHist(ValueError):
    """Not retried: every restart would meet it again."""

    retry = False


def streamed_data(share, tcfg: Mapping[str, Any], params: dict, local_dir: Path):
    """(train matrix, its rows, evaluate): this rank's share of streamed parquet (ctx.share());
    held-out metrics are sums over the ranks' own test rows (xgboost's all-reduce)."""
    if params.get("tree_method", "hist") != "hist" or params.get("booster") == "gblinear":
        raise StreamedNeedsHist(
            f"streamed data is read into XGBoost's QuantileDMatrix, which trains trees with "
            f"tree_method=hist only (trainer.tree_method={params.get('tree_method')!r}, "
            f"booster={params.get('booster', 'gbtree')!r}): use hist and gbtree or dart, or "
            "data.stream=false")
    if tcfg.get("external_memory"):  # the quantised pages live in the worker's local disk
        # (ctx.local_dir: a killed worker's pages, as large as its share, go with its folder)
        folder = tempfile.mkdtemp(prefix="xgb-extmem-", dir=local_dir)
        matrix = xgb.ExtMemQuantileDMatrix(ShareChunks(share, os.path.join(folder, "cache")),
                                           max_bin=params["max_bin"])
        # xgboost removes its pages with the matrix, not the folder: it goes with them.
        weakref.finalize(matrix, shutil.rmtree, folder, True)
    else:
        matrix = xgb.QuantileDMatrix(ShareChunks(share), max_bin=params["max_bin"])

    def evaluate(model: xgb.Booster) -> dict[str, float]:
        sums = sum((metric_sums(model.predict(xgb.DMatrix(x)), y, share.num_classes)
                    for x, y in share.test_chunks()), start=no_sums(share.num_classes))
        sums = np.asarray(sums, dtype=np.float64)
        if xgb.collective.is_distributed():
            sums = xgb.collective.allreduce(sums, xgb.collective.Op.SUM)
        return metrics_from_sums(sums, share.num_classes)

    return matrix, share.rows, evaluate


def in_memory_data(ctx: WorkerContext):
    data = ctx.dataset()
    rows = worker_rows(len(data.y_train), ctx.rank, ctx.world_size)

    def evaluate(model: xgb.Booster) -> dict[str, float]:
        return test_metrics(model.predict(xgb.DMatrix(data.x_test)), data.y_test, data.num_classes)

    return (xgb.DMatrix(data.x_train[rows], label=data.y_train[rows]), len(data.y_train),
            data.num_classes, evaluate)


def main(ctx: WorkerContext, cfg: dict) -> dict[str, float] | None:
    tcfg = cfg["trainer"]
    threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    if ctx.streamed:
        share = ctx.share()
        classes = share.num_classes
        params = booster_params(tcfg, classes, ctx.seed) | {"nthread": threads}
        dtrain, samples, evaluate = streamed_data(share, tcfg, params, ctx.local_dir)
    else:
        dtrain, samples, classes, evaluate = in_memory_data(ctx)
        params = booster_params(tcfg, classes, ctx.seed) | {"nthread": threads}
    booster = None
    if (path := ctx.restore(["model.ubj"])) is not None:
        booster = xgb.Booster(params=params, model_file=str(path / "model.ubj"))
    ctx.total_steps = int(tcfg["num_boost_round"])
    if ctx.start_step < ctx.total_steps:
        booster = xgb.train(params, dtrain, num_boost_round=ctx.total_steps - ctx.start_step,
                            evals=[(dtrain, "train")], verbose_eval=False, xgb_model=booster,
                            callbacks=[_EachRound(ctx, samples, evaluate)])
    return None if ctx.should_preempt() else evaluate(booster)
