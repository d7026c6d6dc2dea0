"""Boosted trees: orchestrated XGBoost and LightGBM on 2 workers against single-process
xgboost.train / lightgbm.train (scripts/baselines/single_boosting.py) on the same synthetic
data, interleaved: wall-time ratios (whole command; training alone) and metric differences."""

from __future__ import annotations

import argparse
from pathlib import Path

from scripts.benchmarks.common import (
    BASELINES,
    PYTHON,
    figure,
    interleave,
    median,
    orchestrator_cmd,
    progress,
    ratio,
    read_json,
    run_timed,
)

FRAMEWORKS = ("xgboost", "lightgbm")


def train_s(record: dict) -> float | None:
    """The orchestrated run's training time: its first worker group's start to its last round
    (run.json's samples_per_s covers exactly that span)."""
    if not record.get("samples_per_s"):
        return None
    return round(record["samples"] / record["samples_per_s"], 3)


def run(args: argparse.Namespace, work: Path) -> dict:
    rows = args.boost_rows
    sides = {}
    for fw in args.boost_frameworks:
        def orchestrated(i: int, fw=fw) -> dict:
            run_dir = work / f"{fw}-orch-{i}"
            timed = run_timed(orchestrator_cmd(run_dir, f"trainer={fw}", "data=synthetic",
                                               f"data.rows={rows}", "cluster.workers=2"),
                              work / f"{fw}-orch-{i}.log")
            rec = read_json(run_dir / "run.json")
            return {"wall_s": timed.wall_s, "train_s": train_s(rec), "metrics": rec.get("metrics")}

        def single(i: int, fw=fw) -> dict:
            out = work / f"{fw}-single-{i}.json"
            timed = run_timed([PYTHON, str(BASELINES / "single_boosting.py"), fw,
                               "--rows", str(rows), "--out", str(out)], work / f"{fw}-single-{i}.log")
            res = read_json(out)
            return {"wall_s": timed.wall_s, "train_s": res.get("train_s"),
                    "metrics": res.get("metrics")}

        sides[f"{fw}_orchestrated"] = orchestrated
        sides[f"{fw}_single"] = single
    runs = interleave(sides, args.repeats, log=lambda m: progress(f"boosting {m}"))
    return summarize(rows, runs, args.boost_frameworks)


def metric_difference(ours: dict | None, theirs: dict | None) -> dict:
    """orchestrated - single, per metric both report."""
    if not ours or not theirs:
        return {}
    return {k: round(ours[k] - theirs[k], 5) for k in sorted(ours) if k in theirs}


def summarize(rows: int, runs: dict[str, list[dict]], frameworks=FRAMEWORKS) -> dict:
    out = {"job": {"data": "synthetic", "rows": rows, "features": 20, "classes": 2,
                   "rounds": 50, "orchestrated": "2 workers x 1 thread",
                   "single": "1 process x all cores, OMP_WAIT_POLICY=PASSIVE",
                   "train_s": "boosting span: orchestrated = first worker group start to last "
                              "round; single = xgboost.train / lightgbm.train"},
           "figures": {}, "runs": runs}
    for fw in frameworks:
        ours, theirs = runs[f"{fw}_orchestrated"], runs[f"{fw}_single"]
        for key in ("wall_s", "train_s"):
            out["figures"][f"{fw}_{key}_ratio"] = figure(
                ratio(median([r[key] for r in ours]), median([r[key] for r in theirs])),
                orchestrated_s=median([r[key] for r in ours]),
                single_s=median([r[key] for r in theirs]))
        out["figures"][f"{fw}_metric_difference"] = metric_difference(ours[-1]["metrics"],
                                                                      theirs[-1]["metrics"])
    return out
