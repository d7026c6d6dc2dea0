"""Recovery after a worker kill against a cold start of the same job, measured in one run:
cold start = command start to the first finished step; recovery = SIGKILL of a training worker
to the next finished step (the new worker group's first step, run.json `world_sizes`)."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

from scripts.benchmarks.common import (
    REPO,
    Goal,
    bench_env,
    figure,
    first_step_at,
    median,
    orchestrator_cmd,
    paired_ratios,
    progress,
    ratio,
    read_json,
)
from scripts.benchmarks.proctree import start, stop_tree

GOAL = Goal("<=", 1.0)
AIM = 0.5


def wait_for(run_dir: Path, predicate, proc, timeout: float) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        rec = read_json(run_dir / "run.json")
        if rec and predicate(rec):
            return rec
        time.sleep(0.05)
    raise RuntimeError(f"timed out or exited (code {proc.poll()}) waiting on {run_dir}")


def one(args: argparse.Namespace, work: Path, i: int) -> dict:
    run_dir = work / f"recovery-{i}"
    run_dir.mkdir(parents=True)
    cmd = orchestrator_cmd(run_dir, "trainer.epochs=100000",
                           f"checkpoint.every_steps={args.recovery_checkpoint_every}")
    started = time.time()
    proc = start(cmd, REPO, bench_env(), work / f"recovery-{i}.log")
    try:
        kill_at = args.recovery_kill_step
        rec = wait_for(run_dir, lambda r: r.get("steps", 0) >= kill_at and
                       len(r.get("workers", [])) == 2 and r.get("checkpoints"), proc, 600)
        cold = first_step_at(rec) - started
        victim = next(w for w in rec["workers"] if w["rank"] == args.recovery_rank)
        groups, step = len(rec["world_sizes"]), rec["steps"]
        killed_at = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        rec = wait_for(run_dir, lambda r: len(r.get("world_sizes", [])) > groups and
                       "first_step_at_s" in r["world_sizes"][-1], proc, 600)
        group = rec["world_sizes"][-1]
        recovered_at = rec["started_at"] + group["first_step_at_s"]
        return {
            "cold_start_s": round(cold, 3),
            "recovery_s": round(recovered_at - killed_at, 3),
            # the new group reported its start (set up, restored) this long after the kill:
            "to_group_started_s": round(rec["started_at"] + group["at_s"] - killed_at, 3),
            "killed_rank": args.recovery_rank, "killed_at_step": step,
            "resumed_at_step": group["step"], "lost_steps": rec.get("lost_steps"),
        }
    finally:
        stop_tree(proc)


def run(args: argparse.Namespace, work: Path) -> dict:
    runs = []
    for i in range(args.repeats):
        begun = time.time()
        runs.append(one(args, work, i))
        progress(f"recovery #{i}: {time.time() - begun:.1f}s {runs[-1]}")
    return summarize(runs, args)


def summarize(runs: list[dict], args: argparse.Namespace | None = None) -> dict:
    cold = median([r["cold_start_s"] for r in runs])
    recovery = median([r["recovery_s"] for r in runs])
    value = ratio(recovery, cold)
    job = {"data": "digits", "batch_size": 64, "workers": 2}
    if args is not None:
        job.update(checkpoint_every_steps=args.recovery_checkpoint_every,
                   kill_after_step=args.recovery_kill_step, killed_rank=args.recovery_rank)
    return {
        "job": job,
        "median_s": {"cold_start": cold, "recovery": recovery,
                     "to_group_started": median([r["to_group_started_s"] for r in runs])},
        "figures": {"recovery_vs_cold_start": figure(
            value, GOAL, aim=AIM, aim_met=None if value is None else value <= AIM,
            paired=paired_ratios([r["recovery_s"] for r in runs],
                                 [r["cold_start_s"] for r in runs]))},
        "runs": runs,
    }
