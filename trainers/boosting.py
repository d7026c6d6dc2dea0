"""What the two boosted-tree trainers share: each worker's shard, the per-round calls to the
worker API, and the final metrics."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.metrics import log_loss, roc_auc_score

from orchestrator.errors import ConfigError


def worker_rows(num_rows: int, rank: int, world_size: int) -> np.ndarray:
    """Every world_size-th row: a resize re-shards the same data over the new workers."""
    return np.arange(rank, num_rows, world_size)


def num_classes_of(data: Mapping[str, Any]) -> int | None:
    """The classes the loop will see (0: regression), from the data config the driver
    completed (data.outputs: the classes found in the data); None when it does not say."""
    if data.get("task") == "regression":
        return 0
    classes = data.get("outputs") or data.get("classes")
    return None if classes is None else int(classes)


def held_out_names(num_classes: int) -> list[str]:
    """The names of the metrics test_metrics (and metrics_from_sums) give."""
    if num_classes == 0:
        return ["test_rmse", "test_r2"]
    return ["test_accuracy", "test_logloss", *(["test_auc"] if num_classes == 2 else [])]


def test_metrics(prediction: np.ndarray, y: np.ndarray, num_classes: int) -> dict[str, float]:
    """Classification metrics from class probabilities, or regression metrics (num_classes 0)."""
    if num_classes == 0:
        return regression_metrics(prediction, y)
    return classification_metrics(prediction, y, num_classes)


def regression_metrics(prediction: np.ndarray, y: np.ndarray) -> dict[str, float]:
    error = np.asarray(prediction, dtype=np.float64).reshape(-1) - y
    total = float(((y - y.mean()) ** 2).sum())
    return {"test_rmse": float(np.sqrt((error ** 2).mean())),
            "test_r2": 1.0 - float((error ** 2).sum()) / total if total > 0 else 0.0}


def classification_metrics(proba: np.ndarray, y: np.ndarray, num_classes: int) -> dict[str, float]:
    """Accuracy and log loss; AUC too for two classes. proba: (rows,) or (rows, classes)."""
    if proba.ndim == 1:
        proba = np.column_stack([1.0 - proba, proba])
    metrics = {
        "test_accuracy": float((proba.argmax(1) == y).mean()),
        "test_logloss": float(log_loss(y, np.clip(proba, 1e-7, 1.0), labels=list(range(num_classes)))),
    }
    if num_classes == 2:
        metrics["test_auc"] = float(roc_auc_score(y, proba[:, 1]))
    return metrics


AUC_BINS = 4096


def metric_sums(prediction: np.ndarray, y: np.ndarray, num_classes: int) -> np.ndarray:
    """The sums test_metrics needs, for this rank's held-out rows (added over the ranks,
    then made metrics by metrics_from_sums): a share's metrics without gathering its rows."""
    if num_classes == 0:
        error = np.asarray(prediction, dtype=np.float64).reshape(-1) - y
        return np.array([len(y), (error ** 2).sum(), y.sum(), (y.astype(np.float64) ** 2).sum()])
    proba = prediction if prediction.ndim == 2 else np.column_stack([1 - prediction, prediction])
    true = np.clip(proba[np.arange(len(y)), y], 1e-7, 1.0)
    sums = [len(y), float((proba.argmax(1) == y).sum()), float(-np.log(true).sum())]
    if num_classes == 2:  # AUC from score histograms (exact to 1/AUC_BINS of a score)
        bins = np.minimum((proba[:, 1] * AUC_BINS).astype(np.int64), AUC_BINS - 1)
        sums += [*np.bincount(bins[y == 1], minlength=AUC_BINS),
                 *np.bincount(bins[y == 0], minlength=AUC_BINS)]
    return np.asarray(sums, dtype=np.float64)


def no_sums(num_classes: int) -> np.ndarray:
    """metric_sums of no rows: what a rank without held-out rows adds (a streamed
    data.eval_path of fewer row groups than workers), of the length the others' have."""
    width = 4 if num_classes == 0 else 3 + (2 * AUC_BINS if num_classes == 2 else 0)
    return np.zeros(width)


def metrics_from_sums(sums: np.ndarray, num_classes: int) -> dict[str, float]:
    n = sums[0]
    if num_classes == 0:
        total = sums[3] - sums[2] ** 2 / n
        return {"test_rmse": float(np.sqrt(sums[1] / n)),
                "test_r2": 1.0 - float(sums[1] / total) if total > 0 else 0.0}
    metrics = {"test_accuracy": float(sums[1] / n), "test_logloss": float(sums[2] / n)}
    if num_classes == 2:
        pos, neg = sums[3:3 + AUC_BINS], sums[3 + AUC_BINS:]
        below = np.cumsum(neg) - neg  # negatives scored in lower bins
        pairs = pos.sum() * neg.sum()
        metrics["test_auc"] = float(((pos * below).sum() + 0.5 * (pos * neg).sum()) / pairs) \
            if pairs else 0.5
    return metrics


def after_round(ctx, rounds: int, metrics: dict, samples: int, evaluate: Callable[[], dict],
                write: Callable[[Path], None]) -> bool:
    """The worker API after a boosting round (every rank ends each round with the same
    model, so rank 0 alone writes it); True when boosting must stop: a preemption notice."""
    ctx.step_done(rounds, metrics, samples)
    if ctx.should_evaluate(rounds):
        ctx.eval_done(rounds, evaluate())
    if ctx.should_save(rounds):
        ctx.save(rounds, lambda folder: write(folder) if ctx.rank == 0 else None)
    return ctx.should_preempt()


def check_params(params: Mapping[str, Any], ours: Mapping[str, set[str]], rounds: set[str],
                 stopping: set[str], library: str) -> None:
    """trainer.params keys that would be ignored or change the run behind its back: another
    name of a parameter the trainer sets (``ours``: trainer key -> the library's names for it;
    the library's main name wins over an alias, silently), the round count (the run's steps
    are trainer.num_boost_round) or early stopping (the trainer evaluates no validation set)."""
    for key in params or {}:
        owner = next((k for k, names in ours.items() if key in names and key != k), None)
        if owner is not None:
            raise ConfigError(f"trainer.params.{key}: {library} takes it as the trainer's own "
                              f"trainer.{owner}, which wins: set trainer.{owner}")
        if key in rounds:
            raise ConfigError(f"trainer.params.{key}: the rounds are trainer.num_boost_round "
                              "(the run's steps, checkpoints and resume count them)")
        if key in stopping:
            raise ConfigError(f"trainer.params.{key}: early stopping is not supported (the run "
                              "evaluates no validation set while it trains); set "
                              "trainer.num_boost_round")


def tiny_problem(classes: int) -> tuple[np.ndarray, np.ndarray]:
    """A few rows of labels 0..classes-1 (2 when the data does not say), for the check."""
    classes = classes or 2
    y = np.arange(8 * classes) % classes
    x = np.column_stack([y + 0.1 * np.sin(np.arange(len(y))), np.cos(np.arange(len(y)))])
    return x.astype(np.float32), y.astype(np.float32)


def check_probabilities(prediction: np.ndarray, classes: int, key: str, objective: str) -> None:
    """A classifier's held-out metrics read its predictions as class probabilities (P(class 1)
    a row for two classes, a row of k summing to 1 for more): an objective that gives margins,
    class ids or scores trains to the end, then its metrics are nonsense or fail."""
    prediction = np.asarray(prediction, dtype=np.float64)
    want = (len(prediction),) if classes == 2 else (len(prediction), classes)
    fine = prediction.shape == want and np.all((prediction >= 0) & (prediction <= 1))
    if fine and classes > 2:
        fine = bool(np.allclose(prediction.sum(1), 1.0, atol=1e-4))
    if not fine:
        raise ConfigError(
            f"{key}: the objective {objective!r} does not give class probabilities for the "
            f"data's {classes} classes (its predictions: shape {prediction.shape}), which the "
            "held-out metrics read: use the default (null), or data.task=regression for a "
            "number to predict")


def boosting_error_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    # XGBoost and LightGBM put the useful sentence after a location prefix.
    useful = [ln for ln in lines if "rror" in ln or "nknown" in ln or "nvalid" in ln]
    line = (useful or lines or [type(exc).__name__])[0]
    # XGBoost's "[00:11:46] /__w/xgboost/xgboost/src/objective/regression_obj.cu:114: Check
    # failed: ...": its clock and source file say nothing to the user.
    return re.sub(r"^\[[\d:.]+\]\s*(\S+\.(cu|cc|h):\d+:\s*)?", "", line)[:300]


@contextmanager
def native_stderr_silenced():
    """The C++ side of LightGBM prints its fatal errors itself; we surface them as one line."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
