"""Asynchronous against synchronous training with one slow worker (issue 63): trainer=tf_ps
(4 workers, 1 parameter server) and trainer=mwms (4 workers), the same Keras MLP on the
bundled digits. Each run trains steadily, then one worker is stopped (SIGSTOP) for
--ps-stop-s seconds and let go on (SIGCONT).

Samples/s in three windows of each run: before the stop, while the worker is stopped, after.
Figures: the stopped window's samples/s over the one before, per side. Asynchronous training
should keep most of its speed (goal >= 0.5: three of four workers go on), where synchronous
training stalls (every step waits for every worker's gradients).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from pathlib import Path

from scripts.benchmarks.common import (
    REPO,
    Goal,
    bench_env,
    figure,
    median,
    orchestrator_cmd,
    order_for,
    progress,
    read_json,
)

SIDES = {
    "tf_ps": ["trainer=tf_ps", "trainer.ps=1"],
    "mwms": ["trainer=mwms"],
}
COMMON = ["cluster.workers=4", "data=digits", "trainer.epochs=100000", "trainer.lr=0.05",
          "checkpoint.every_steps=100000", "log.metrics=false", "resume=never",
          "failure.hang_timeout_s=600", "log.progress=lines"]


def samples_at(run_dir: Path) -> tuple[float, int]:
    return time.monotonic(), int(read_json(run_dir / "run.json").get("samples") or 0)


def rate(a: tuple[float, int], b: tuple[float, int]) -> float:
    return round((b[1] - a[1]) / max(b[0] - a[0], 1e-9), 1)


def slow_worker_pid(record: dict, side: str) -> int | None:
    if side == "tf_ps":
        workers = (record.get("processes") or {}).get("workers") or []
        return workers[-1]["pid"] if len(workers) == 4 and workers[-1].get("pid") else None
    workers = record.get("workers") or []
    return workers[-1]["pid"] if len(workers) == 4 else None


def one_run(side: str, run_dir: Path, args: argparse.Namespace) -> dict:
    cmd = orchestrator_cmd(run_dir, *SIDES[side], *COMMON)
    with open(run_dir.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=bench_env(), stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while True:  # steady: past the first steps, every worker known
            record = read_json(run_dir / "run.json")
            pid = slow_worker_pid(record, side)
            if pid and (record.get("steps") or 0) >= args.ps_warm_steps:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{side} did not start: {run_dir.with_suffix('.log')}")
            time.sleep(0.5)
        start = samples_at(run_dir)
        time.sleep(args.ps_window_s)
        before = samples_at(run_dir)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(args.ps_stop_s)
            stopped = samples_at(run_dir)
        finally:
            os.kill(pid, signal.SIGCONT)
        time.sleep(args.ps_window_s)
        after = samples_at(run_dir)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {"samples_per_s_before": rate(start, before),
            "samples_per_s_stopped": rate(before, stopped),
            "samples_per_s_after": rate(stopped, after)}


def summarize(runs: dict[str, list[dict]]) -> dict:
    kept = {side: [r["samples_per_s_stopped"] / r["samples_per_s_before"]
                   for r in rows if r["samples_per_s_before"]] for side, rows in runs.items()}
    return {"runs": runs, "figures": {
        "tf_ps_speed_kept_with_a_worker_stopped": figure(median(kept["tf_ps"]), Goal(">=", 0.5),
                                                         each=kept["tf_ps"]),
        "mwms_speed_kept_with_a_worker_stopped": figure(median(kept["mwms"]),
                                                        each=kept["mwms"])}}


def run(args: argparse.Namespace, work: Path) -> dict:
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for repeat in range(args.repeats):
        for side in order_for(repeat, list(SIDES)):
            progress(f"ps: {side}, repeat {repeat}")
            runs[side].append(one_run(side, work / f"{side}-{repeat}", args))
    return {"stop_s": args.ps_stop_s, "window_s": args.ps_window_s, **summarize(runs)}
