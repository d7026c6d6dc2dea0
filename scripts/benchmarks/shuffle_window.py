"""The streamed window shuffle against the exact full shuffle (issue 28): the default job
(trainer=ddp, 2 workers, 10 epochs) on the bundled digits written as parquet, its training rows
(4 of 5) in 6 files of 3 row groups and its held-out rows (data.eval_path) apart, so both sides
train and evaluate on the same rows. Streamed (data.stream=true, data.window=W: row groups
permuted per epoch, rows shuffled within a window of W row groups) against the same data held
in memory (data.stream=false: every row shuffled every epoch), a few seeds each, interleaved.

Figure: the median over seeds of test accuracy streamed minus in memory (goal: within 0.01).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from scripts.benchmarks.common import (
    Goal,
    figure,
    median,
    orchestrator_cmd,
    order_for,
    progress,
    read_json,
    run_timed,
)


def write_digits(folder: Path) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from orchestrator.data.datasets import digits

    x, y = digits()
    train, held_out = folder / "train", folder / "eval"
    for part in (train, held_out):
        part.mkdir(parents=True, exist_ok=True)
    rows = np.arange(len(y))

    def table(picked):
        return pa.table({**{f"p{i}": x[picked, i].astype(np.float32) for i in range(64)},
                         "label": y[picked]})

    for f, picked in enumerate(np.array_split(rows[rows % 5 != 0], 6)):
        pq.write_table(table(picked), train / f"digits-{f}.parquet", row_group_size=80)
    pq.write_table(table(rows[rows % 5 == 0]), held_out / "digits.parquet")
    return train, held_out


def run(args: argparse.Namespace, work: Path) -> dict:
    train, held_out = write_digits(work / "data")
    sides = {"streamed": ["data.stream=true", f"data.window={args.shuffle_window}"],
             "in_memory": ["data.stream=false"]}
    accuracy: dict[str, list[float]] = {side: [] for side in sides}
    for repeat, seed in enumerate(range(args.shuffle_seeds)):
        for side in order_for(repeat, list(sides)):
            run_dir = work / f"{side}-{seed}"
            progress(f"shuffle_window: {side}, seed {seed}")
            run_timed(orchestrator_cmd(run_dir, "trainer=ddp", "data=parquet",
                                       f"data.path={train}", f"data.eval_path={held_out}",
                                       f"seed={seed}", "log.metrics=false", "resume=never",
                                       *sides[side]), work / f"{side}-{seed}.log")
            accuracy[side].append(read_json(run_dir / "run.json")["metrics"]["test_accuracy"])
    differences = [round(a - b, 4) for a, b in zip(accuracy["streamed"], accuracy["in_memory"],
                                                   strict=True)]
    return {"window": args.shuffle_window, "seeds": args.shuffle_seeds, "accuracy": accuracy,
            "figures": {"test_accuracy_streamed_minus_in_memory": figure(
                median(differences), Goal(">=", -0.01), each=differences)}}
