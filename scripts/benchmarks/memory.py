"""Memory: peak resident memory (VmHWM) of the driver and of each training worker for the
default job (`python -m orchestrator`: DDP on digits, 2 workers) against the plain Ray Train
script on the same job, interleaved; the command's whole process tree is polled. The runs are
fixed_cost's (the same two commands): `bench.py all` measures both in one set of runs."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from scripts.benchmarks.common import REPO, Timed, bench_env, figure, median, ratio
from scripts.benchmarks.proctree import TreeWatcher, start, stop_tree


def run_watched(cmd: list[str], log: Path, env: dict | None = None, timeout: float = 900,
                series: bool = False, cwd: Path = REPO) -> tuple[Timed, dict]:
    """Run a command to its end while polling its process tree; (timing, peak memory and CPU
    seconds; with series, the training workers' sampled CPU under "series")."""
    started = time.time()
    proc = start(cmd, cwd, bench_env(env), log)
    watcher = TreeWatcher(proc.pid).start()
    try:
        proc.wait(timeout=timeout)
    finally:
        ended = time.time()
        peaks = watcher.stop()
        stop_tree(proc)
    if series:
        peaks["series"] = watcher.series
    output = log.read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{output[-3000:]}")
    return Timed(started, ended, proc.returncode, output), peaks


def run(args: argparse.Namespace, work: Path) -> dict:
    from scripts.benchmarks import fixed_cost

    args = argparse.Namespace(**{**vars(args), "fixed_variants": [], "sweep_trials": 0})
    return from_runs(fixed_cost.run(args, work)["runs"])


def from_runs(runs: dict[str, list[dict]]) -> dict:
    """The memory figures of fixed_cost's runs (each has its `memory` peaks)."""
    return summarize({side: [r["memory"] for r in runs[side]]
                      for side in ("orchestrator", "ray_train")})


def summarize(runs: dict[str, list[dict]]) -> dict:
    def med(side: str, pick) -> float | None:
        return median([pick(r) for r in runs[side]])

    def worker_max(r: dict) -> float | None:
        return max(r["train_workers_mib"]) if r["train_workers_mib"] else None

    picks = {"driver_mib": lambda r: r["driver_mib"], "worker_max_mib": worker_max,
             "tree_rss_peak_mib": lambda r: r["tree_rss_peak_mib"]}
    medians = {side: {k: med(side, p) for k, p in picks.items()} for side in runs}
    return {
        "job": {"data": "digits", "epochs": 10, "batch_size": 64, "workers": 2},
        "median_mib": medians,
        "figures": {f"{k.removesuffix('_mib')}_ratio": figure(
            ratio(medians["orchestrator"][k], medians["ray_train"][k]))
            for k in picks},
        "runs": runs,
    }
