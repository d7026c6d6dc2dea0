"""LightGBM's loop (the training function is trainers/lightgbm/train.py): one step is one
boosting round.

Workers hold pre-partitioned shards and train with tree_learner=data_parallel over the
network Ray Train sets up; every worker ends each round with the same model. A resume
continues from the saved model (init_model), not from zero.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np
import ray.train.lightgbm

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
    aliases = lgb.basic._ConfigAliases.get  # LightGBM's own table of its parameters' names
    check_params(config.get("params"), {k: aliases(k) for k in PARAM_KEYS},
                 aliases("num_iterations"), aliases("early_stopping_round"), "LightGBM")
    known = num_classes_of(cfg["data"])
    classes = 2 if known is None else known
    x, y = tiny_problem(classes)
    logged: dict = {}
    params = booster_params(config, classes, 0)
    key = "trainer.objective" if config.get("objective") else "trainer.params"
    try:
        with native_stderr_silenced():
            train_set = lgb.Dataset(x, label=y)
            model = lgb.train(params, train_set, num_boost_round=1, valid_sets=[train_set],
                              valid_names=["train"], callbacks=[lgb.record_evaluation(logged)])
            prediction = model.predict(x)
    except lgb.basic.LightGBMError as exc:
        raise ConfigError(f"{key}: LightGBM refuses it: {boosting_error_line(exc)}") from exc
    if classes:
        check_probabilities(prediction, classes, key, params["objective"])
    if known is None:  # the metrics depend on the classes (test_auc for two)
        return None
    return held_out_names(classes) + [f"train_{name}" for name in logged.get("train", {})]


class InMemory:
    """The dataset held whole (ctx.dataset()): this rank trains on every world_size-th row;
    every rank evaluates on all the test rows."""

    def __init__(self, ctx: WorkerContext):
        data = self.data = ctx.dataset()
        self.num_classes, self.samples = data.num_classes, len(data.y_train)
        self.rows = worker_rows(len(data.y_train), ctx.rank, ctx.world_size)

    def train_set(self, params: dict) -> lgb.Dataset:
        return lgb.Dataset(self.data.x_train[self.rows], label=self.data.y_train[self.rows],
                           free_raw_data=False)

    def metrics(self, model: lgb.Booster) -> dict[str, float]:
        return test_metrics(np.asarray(model.predict(self.data.x_test)), self.data.y_test,
                            self.num_classes)


def bins_reference(bounds) -> lgb.Dataset:
    """A tiny dataset whose bins are the driver's bounds, built the same on every rank (its
    rows are the bounds themselves, binned by them as forced bins, with room for LightGBM's own
    bin at zero and none to draw from data): a share's dataset takes its bins from it, so no
    rank finds bins from its own rows. Not LightGBM's distributed bin finding with forced bins:
    in LightGBM 4.7 a machine other than the first applies the forced bounds of the wrong
    features (measured: rank 1's features 8-15 split at the bounds of features 0-7)."""
    forced = Path(tempfile.mkdtemp(prefix="lgb-bins-")) / "forced_bins.json"
    forced.write_text(json.dumps([{"feature": f, "bin_upper_bound": list(b)}
                                  for f, b in enumerate(bounds) if b]))
    rows = max((len(b) for b in bounds), default=1) or 1
    x = np.array([[b[min(i, len(b) - 1)] if b else 0.0 for b in bounds] for i in range(rows)])
    own = {"forcedbins_filename": str(forced), "feature_pre_filter": False,
           "max_bin_by_feature": [len(b) + 1 for b in bounds]}  # measured: no bin of a share's own
    # Built before lgb.train joins the network, without its parameters: bins found locally.
    reference = lgb.Dataset(x, label=np.zeros(rows), params={"verbosity": -1, **own},
                            free_raw_data=False)
    try:
        return reference.construct()
    finally:  # read while it was built: the bins are the dataset's own from then on
        shutil.rmtree(forced.parent, ignore_errors=True)


class GroupRows(lgb.Sequence):
    """One row group's training rows of a rank's share, read when LightGBM asks for them (in
    one batch); their labels kept as they go by."""

    def __init__(self, share, g: int):
        self.share, self.g = share, g
        self.rows = int(share.order.train_rows[g])
        self.batch_size = max(1, self.rows)  # one read for the group (a step of 0 is no range)
        self.labels = np.zeros(0)

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, idx):
        x, y = self.share.train_rows(self.g)
        self.labels = y
        return x[idx]


def go_on_from(train_set: lgb.Dataset, resumed: lgb.Booster, groups: list[GroupRows]) -> None:
    """A saved model continued over streamed rows. lgb.train(init_model=...) has the dataset
    predict its raw rows for their starting scores, which a dataset built from row groups no
    longer holds ("Cannot set predictor after freed raw data"). The scores are predicted here,
    a row group at a time, and the dataset takes lgb.train's predictor as it is (LightGBM
    4.7's private Dataset._set_predictor; the Booster still merges the saved trees): the same
    model as a run that never stopped (tests/test_streaming.py)."""
    scores = [resumed.predict(group[np.arange(len(group))], raw_score=True) for group in groups]
    train_set.set_init_score(np.concatenate(scores))

    def take(predictor):
        train_set._predictor = predictor
        return train_set

    train_set._set_predictor = take


class Streamed:
    """Streamed parquet (ctx.share()): this rank reads only its own row groups, one at a time,
    into LightGBM's binned dataset; the bins are the driver's (bins_reference, the same at any
    world size); held-out
    metrics add up every rank's sums over its own test rows."""

    def __init__(self, ctx: WorkerContext):
        self.ctx, self.share = ctx, ctx.share()
        self.num_classes, self.samples = self.share.num_classes, self.share.rows

    def train_set(self, params: dict, resumed: lgb.Booster | None = None) -> lgb.Dataset:
        """Binned a row group at a time: LightGBM reads each group when it pushes its rows (it
        samples none, the bins being the reference's), so the share is never held as floats."""
        # Its parameters are the training's, its bins the reference's: by design, not news.
        warnings.filterwarnings("ignore", "Overriding the parameters from Reference Dataset")
        groups = [GroupRows(self.share, g) for g in self.share.groups]
        train_set = lgb.Dataset(groups, params=params,
                                reference=bins_reference(self.share.bin_bounds)).construct()
        train_set.set_label(np.concatenate([group.labels for group in groups]))
        if resumed is not None:
            go_on_from(train_set, resumed, groups)
        return train_set

    def metrics(self, model: lgb.Booster) -> dict[str, float]:
        sums = sum((metric_sums(np.asarray(model.predict(x)), y, self.num_classes)
                    for x, y in self.share.test_chunks()), start=no_sums(self.num_classes))
        return metrics_from_sums(self.ctx.sum_over_ranks(sums), self.num_classes)


def main(ctx: WorkerContext, cfg: dict) -> dict[str, float] | None:
    tcfg = cfg["trainer"]
    data = Streamed(ctx) if ctx.streamed else InMemory(ctx)
    threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    params = booster_params(tcfg, data.num_classes, ctx.seed) | {"num_threads": threads}
    if ctx.world_size > 1:
        params.update(ray.train.lightgbm.get_network_params(), tree_learner="data_parallel",
                      pre_partition=True)
    booster = None
    if (path := ctx.restore(["model.txt"])) is not None:
        booster = lgb.Booster(model_file=str(path / "model.txt"))
    ctx.total_steps = int(tcfg["num_boost_round"])

    def each_round(env) -> None:
        metrics = {f"train_{name}": float(value) for _, name, value, _ in env.evaluation_result_list}
        if after_round(ctx, env.iteration + 1, metrics, data.samples,
                       lambda: data.metrics(env.model),
                       lambda folder: env.model.save_model(str(folder / "model.txt"))):
            raise lgb.callback.EarlyStopException(env.iteration, env.evaluation_result_list)

    if ctx.start_step < ctx.total_steps:
        train_set = data.train_set(params, booster) if ctx.streamed else data.train_set(params)
        booster = lgb.train(params, train_set, num_boost_round=ctx.total_steps - ctx.start_step,
                            init_model=booster, valid_sets=[train_set], valid_names=["train"],
                            callbacks=[each_round])
    return None if ctx.should_preempt() else data.metrics(booster)
