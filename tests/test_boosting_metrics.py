"""A share's held-out metrics added over the ranks (trainers/boosting.py metric_sums) are the
metrics of all the rows at once; the driver's check names the metrics the loop reports."""

from __future__ import annotations

import importlib
import re
from types import SimpleNamespace

import numpy as np
import pytest

from orchestrator.errors import ConfigError
from orchestrator.worker.training_function import check_training
from trainers.boosting import held_out_names, metric_sums, metrics_from_sums
from trainers.boosting import test_metrics as metrics_of_all_rows


@pytest.mark.parametrize("classes", [0, 2, 3])
def test_metrics_summed_over_ranks_are_the_metrics_of_all_rows(classes):
    rng = np.random.default_rng(classes)
    n = 3000
    if classes == 0:
        y = rng.normal(size=n)
        prediction = y + rng.normal(scale=0.5, size=n)
    else:
        y = rng.integers(0, classes, size=n)
        logits = rng.normal(size=(n, classes)) + 1.5 * np.eye(classes)[y]
        prediction = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        if classes == 2:
            prediction = prediction[:, 1]
    whole = metrics_of_all_rows(prediction, y, classes)
    parts = [slice(0, 1000), slice(1000, 1700), slice(1700, n)]  # three ranks' shares
    summed = metrics_from_sums(sum(metric_sums(prediction[p], y[p], classes) for p in parts),
                               classes)
    assert set(summed) == set(whole) == set(held_out_names(classes))
    for name, value in whole.items():
        tolerance = 1e-3 if name == "test_auc" else 1e-9  # AUC from 4096-bin histograms
        assert summed[name] == pytest.approx(value, abs=tolerance), name


class OneRank:
    """The worker API as a single rank's loop sees it, keeping the names of what it reports."""

    rank, world_size, seed, start_step, streamed, total_steps = 0, 1, 0, 0, False, None

    def __init__(self, data):
        self.data, self.reported = data, set()

    def dataset(self):
        return self.data

    def restore(self, files=None):
        return None

    def step_done(self, step, metrics=None, samples=0):
        self.reported |= set(metrics or {})

    def should_evaluate(self, step):
        return False

    def should_save(self, step):
        return False

    def should_preempt(self):
        return False


@pytest.mark.parametrize("trainer, params, classes", [
    *((trainer, {}, classes) for trainer in ("xgboost", "lightgbm") for classes in (0, 2, 3)),
    ("xgboost", {"eval_metric": ["error", "logloss"]}, 2),  # the user's: the framework's log says
])
def test_the_check_names_what_the_loop_reports(trainer, params, classes):
    data = {"task": "regression" if classes == 0 else "classification", "outputs": classes or 1}
    training = check_training({"fn": f"trainers.{trainer}.train:main", "num_boost_round": 2,
                               "params": params}, data)
    rng = np.random.default_rng(0)
    y = rng.normal(size=60) if classes == 0 else np.arange(60) % classes
    x = np.column_stack([y + rng.normal(scale=0.3, size=60), rng.normal(size=60)])
    ctx = OneRank(SimpleNamespace(x_train=x[:40], y_train=y[:40], x_test=x[40:], y_test=y[40:],
                                  num_classes=classes))
    loop = importlib.import_module(f"trainers.{trainer}.loop")
    final = loop.main(ctx, {"trainer": training.config, "data": data})
    assert set(training.metrics) == set(final) | ctx.reported


@pytest.mark.parametrize("trainer", ["xgboost", "lightgbm"])
def test_a_check_that_does_not_know_the_classes_does_not_say(trainer):
    training = check_training({"fn": f"trainers.{trainer}.train:main"}, {"task": "classification"})
    assert training.metrics is None


@pytest.mark.parametrize("classes", [0, 2, 3])
def test_a_rank_without_held_out_rows_adds_sums_of_the_others_length(classes):
    """A streamed data.eval_path of fewer row groups than workers leaves a rank no held-out
    rows: its sums must all-reduce with the others' (xgboost's all-reduce refused (1,) against
    (8195,), and a wrong answer came back to that rank)."""
    from trainers.boosting import no_sums

    rng = np.random.default_rng(0)
    y = rng.normal(size=50) if classes == 0 else rng.integers(0, classes, size=50)
    prediction = rng.random(50) if classes in (0, 2) else rng.dirichlet(np.ones(classes), 50)
    sums = metric_sums(prediction, y, classes)
    assert no_sums(classes).shape == sums.shape
    assert metrics_from_sums(sums + no_sums(classes), classes) == metrics_from_sums(sums, classes)


@pytest.mark.parametrize("trainer, params, message", [
    ("lightgbm", {"eta": 0.5}, "trainer.params.eta: LightGBM takes it as the trainer's own "
                               "trainer.learning_rate, which wins"),
    ("lightgbm", {"min_child_samples": 200}, "trainer.min_data_in_leaf"),
    ("lightgbm", {"n_estimators": 7}, "trainer.params.n_estimators: the rounds are "
                                      "trainer.num_boost_round"),
    ("lightgbm", {"early_stopping_round": 3}, "early stopping is not supported"),
    ("xgboost", {"lambda": 100}, "trainer.params.lambda: XGBoost takes it as the trainer's own "
                                 "trainer.reg_lambda"),
    ("xgboost", {"n_estimators": 7}, "the rounds are trainer.num_boost_round"),
])
def test_params_the_run_would_ignore_or_that_change_its_rounds_are_refused(trainer, params,
                                                                           message):
    """LightGBM lets the trainer's own name beat an alias, silently (each of these left the
    model file as before); a round count in params made every round past the trainer's a
    final one (a checkpoint each)."""
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_training({"fn": f"trainers.{trainer}.train:main", "params": params},
                       {"task": "classification", "outputs": 2})
    check_training({"fn": f"trainers.{trainer}.train:main", "params": {"max_bin": 63}},
                   {"task": "classification", "outputs": 2})  # a parameter of its own: passes


@pytest.mark.parametrize("trainer, objective, classes, refusal", [
    ("xgboost", "multi:softmax", 3, "does not give class probabilities for the data's 3 classes"),
    ("xgboost", "binary:logitraw", 2, "does not give class probabilities"),
    ("xgboost", "reg:squarederror", 3, "does not give class probabilities"),
    ("xgboost", "binary:logistic", 3, "XGBoost refuses it: label must be in (0, 1)"),
    ("lightgbm", "binary", 3, "does not give class probabilities"),
    ("lightgbm", "regression", 3, "does not give class probabilities"),
    ("xgboost", "multi:softprob", 3, None), ("lightgbm", "multiclass", 3, None),
    ("xgboost", "binary:logistic", 2, None),
])
def test_an_objective_is_tried_on_the_datas_classes_and_must_give_probabilities(
        trainer, objective, classes, refusal):
    """Tried on labels 0 and 1 only, these passed the check, then crashed on a worker at the
    first round or after the last (the metrics), or reported nonsense."""
    keys = {"fn": f"trainers.{trainer}.train:main", "objective": objective}
    data = {"task": "classification", "outputs": classes}
    if refusal is None:
        check_training(keys, data)
        return
    with pytest.raises(ConfigError, match=r"^trainer.objective: .*" + re.escape(refusal)):
        check_training(keys, data)
