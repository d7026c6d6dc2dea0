"""Baseline: single-process xgboost.train / lightgbm.train on the orchestrator's data.

    python scripts/baselines/single_boosting.py xgboost --rows 1000000 --out result.json
    python scripts/baselines/single_boosting.py lightgbm --rows 1000000

No Ray. The same synthetic data and train/test split as `python -m orchestrator
trainer=<framework> data=synthetic data.rows=N`, the trainers' default parameters, every core
of the machine (nthread / num_threads = cpu count) in one process. Prints JSON: the training
seconds and the same test metrics the orchestrated trainers report.

OMP_WAIT_POLICY=PASSIVE unless set: on a loaded machine, OpenMP threads that spin at barriers
wait for each other's time slices (measured here: 2 threads 78 s, 1 thread 41 s, 2 passive
threads 23 s). The orchestrated workers run one thread each, so they never wait that way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

STARTED_AT = time.time()
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when the OpenMP runtime loads
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import numpy as np  # noqa: E402

from orchestrator.config.schema import DataConfig  # noqa: E402
from orchestrator.data.datasets import load_dataset  # noqa: E402
from trainers.boosting import classification_metrics  # noqa: E402

# The trainers' defaults (trainers/xgboost/config.py, trainers/lightgbm/config.py), for 2 classes.
XGBOOST = {"max_depth": 6, "eta": 0.3, "subsample": 1.0, "colsample_bytree": 1.0,
           "min_child_weight": 1.0, "reg_lambda": 1.0, "tree_method": "hist", "max_bin": 256,
           "objective": "binary:logistic"}
LIGHTGBM = {"num_leaves": 31, "learning_rate": 0.1, "max_depth": -1, "min_data_in_leaf": 20,
            "feature_fraction": 1.0, "lambda_l2": 0.0, "objective": "binary",
            "deterministic": True, "force_row_wise": True, "verbosity": -1}


def train_xgboost(data, rounds: int, seed: int, threads: int) -> tuple[np.ndarray, float]:
    """(test probabilities, training seconds). As in the orchestrated trainer, the DMatrix is
    built before the timed span and the span is the boosting alone."""
    import xgboost as xgb

    params = XGBOOST | {"seed": seed, "nthread": threads}
    dtrain = xgb.DMatrix(data.x_train, label=data.y_train, nthread=threads)
    started = time.perf_counter()
    booster = xgb.train(params, dtrain, num_boost_round=rounds)
    train_s = time.perf_counter() - started
    return booster.predict(xgb.DMatrix(data.x_test)), train_s


def train_lightgbm(data, rounds: int, seed: int, threads: int) -> tuple[np.ndarray, float]:
    """As in the orchestrated trainer, the Dataset's construction (binning) is in the span."""
    import lightgbm as lgb

    params = LIGHTGBM | {"seed": seed, "num_threads": threads}
    started = time.perf_counter()
    booster = lgb.train(params, lgb.Dataset(data.x_train, label=data.y_train),
                        num_boost_round=rounds)
    train_s = time.perf_counter() - started
    return np.asarray(booster.predict(data.x_test)), train_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("framework", choices=("xgboost", "lightgbm"))
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--features", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    data = load_dataset(DataConfig(name="synthetic", rows=args.rows, features=args.features,
                                   classes=2), args.seed)
    train = train_xgboost if args.framework == "xgboost" else train_lightgbm
    proba, train_s = train(data, args.rounds, args.seed, args.threads)
    result = {"framework": args.framework, "rows": args.rows, "rounds": args.rounds,
              "threads": args.threads, "omp_wait_policy": os.environ["OMP_WAIT_POLICY"], "started_at": STARTED_AT, "train_s": round(train_s, 3),
              "metrics": classification_metrics(proba, data.y_test, 2)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
