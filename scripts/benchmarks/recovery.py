"""Recovery after a worker kill against a cold start of the same job, measured in one run:
cold start = command start to the first finished step; recovery = SIGKILL of a training worker
to the next finished step (the new worker group's first step, run.json `world_sizes`).
With --fixed-tree DIR, each repeat also runs the same job with that checkout's driver and
controller (as fixed_cost's orchestrator_tree side), right after this tree's: the two trees'
recoveries measured side by side.

This tree's job has each worker keep a process ready for its replacement
(failure.spare_after_s=--recovery-spare-after-s; orchestrator/worker/spare.py), and the kill
waits until both are ready (idle, their imports done): the recovery a run sees once its
group has trained that long. --recovery-spare-after-s none measures a run without them.
--recovery-kill-after-s puts every side's kill at least that long after its first step, so
that each kills a run as far along (the spares' wait included)."""

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
    order_for,
    paired_ratios,
    progress,
    ratio,
    read_json,
)
from scripts.benchmarks.proctree import cmdline, cpu_s, descendants, start, stop_tree

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


def spare_flag(after_s: float | None) -> str:
    return "null" if after_s is None else str(after_s)


def spares_ready(root: int, workers: set[int], count: int, timeout: float = 120) -> None:
    """Wait until the command's tree holds ``count`` idle worker processes besides the workers
    (ray::IDLE) whose CPU time stands still (their imports done)."""
    deadline, last = time.time() + timeout, None
    while time.time() < deadline:
        idle = {p: cpu_s(p) for p in descendants(root)
                if p not in workers and cmdline(p).startswith("ray::IDLE")}
        if len(idle) >= count and idle == last:
            return
        last = idle
        time.sleep(0.5)
    raise RuntimeError(f"no {count} processes kept ready after {timeout} s")


def one(args: argparse.Namespace, work: Path, i: int, tree: str | None = None) -> dict:
    name = f"recovery-{i}" + ("-tree" if tree else "")
    run_dir = work / name
    run_dir.mkdir(parents=True)
    spare_after = None if tree else getattr(args, "recovery_spare_after_s", None)
    cmd = orchestrator_cmd(run_dir, "trainer.epochs=100000",
                           f"checkpoint.every_steps={args.recovery_checkpoint_every}",
                           *([] if tree else [f"failure.spare_after_s={spare_flag(spare_after)}"]))
    env = bench_env({"PYTHONSAFEPATH": "1", "PYTHONPATH": tree} if tree else None)
    started = time.time()
    # From the tree's folder: Ray puts the driver's folder first on its processes' sys.path.
    proc = start(cmd, Path(tree) if tree else REPO, env, work / f"{name}.log")
    try:
        kill_at = args.recovery_kill_step
        rec = wait_for(run_dir, lambda r: r.get("steps", 0) >= kill_at and
                       len(r.get("workers", [])) == 2 and r.get("checkpoints"), proc, 600)
        cold = first_step_at(rec) - started
        if spare_after is not None:
            spares_ready(proc.pid, {w["pid"] for w in rec["workers"]}, len(rec["workers"]))
        # Both sides' kill at the same time into the run (with spares or without)
        time.sleep(max(0.0, first_step_at(rec) + getattr(args, "recovery_kill_after_s", 0.0)
                       - time.time()))
        rec = read_json(run_dir / "run.json")
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
    tree = getattr(args, "fixed_tree", None)
    sides: dict[str, list[dict]] = {"this": [], "tree": []}
    for i in range(args.repeats):
        for side in order_for(i, ["this", "tree"] if tree else ["this"]):
            begun = time.time()
            sides[side].append(one(args, work, i, tree if side == "tree" else None))
            progress(f"recovery #{i} ({side}): {time.time() - begun:.1f}s {sides[side][-1]}")
    runs, tree_runs = sides["this"], sides["tree"]
    result = summarize(runs, args)
    if tree_runs:
        theirs = summarize(tree_runs)
        result["tree"] = {"path": tree, "median_s": theirs["median_s"], "runs": tree_runs,
                          "recovery_vs_cold_start": theirs["figures"]["recovery_vs_cold_start"],
                          "recovery_vs_tree": figure(
                              ratio(result["median_s"]["recovery"], theirs["median_s"]["recovery"]),
                              paired=paired_ratios([r["recovery_s"] for r in runs],
                                                   [r["recovery_s"] for r in tree_runs]))}
    return result


def summarize(runs: list[dict], args: argparse.Namespace | None = None) -> dict:
    cold = median([r["cold_start_s"] for r in runs])
    recovery = median([r["recovery_s"] for r in runs])
    value = ratio(recovery, cold)
    job = {"data": "digits", "batch_size": 64, "workers": 2}
    if args is not None:
        job.update(checkpoint_every_steps=args.recovery_checkpoint_every,
                   kill_after_step=args.recovery_kill_step, killed_rank=args.recovery_rank,
                   kill_after_s=getattr(args, "recovery_kill_after_s", 0.0),
                   spare_after_s=getattr(args, "recovery_spare_after_s", None))
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
