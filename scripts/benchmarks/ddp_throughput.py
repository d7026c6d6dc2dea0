"""DDP steady-state throughput: the orchestrator against a plain Ray Train TorchTrainer script
and against torchrun with plain torch.distributed (gloo), the same model, data and per-worker
batch, interleaved. Steady state: global samples/s from the end of the first step to the end of
the last one (the orchestrator's `samples_per_s` in run.json), on a run of many steps.
Also per CPU-second of the training workers over that window (sampled from /proc): on a
shared, loaded machine the wall-clock rate mostly measures how often the workers got a core."""

from __future__ import annotations

import argparse
from pathlib import Path

from scripts.benchmarks.common import (
    BASELINES,
    PYTHON,
    Goal,
    figure,
    interleave,
    median,
    orchestrator_cmd,
    paired_ratios,
    progress,
    ratio,
    read_json,
)
from scripts.benchmarks.memory import run_watched
from scripts.benchmarks.proctree import cpu_between

GOAL_VS_RAY_TRAIN = Goal(">=", 0.97)


def job(args: argparse.Namespace) -> dict:
    return {"data": "synthetic", "rows": args.ddp_rows, "features": 64, "classes": 10,
            "batch_size": args.ddp_batch, "steps": args.ddp_steps, "workers": 2,
            "model": "MLP 64-128-64-10", "optimizer": "sgd momentum 0.9"}


def baseline_args(spec: dict, out: Path) -> list[str]:
    return ["--data", "synthetic", "--rows", str(spec["rows"]), "--features", str(spec["features"]),
            "--classes", str(spec["classes"]), "--batch-size", str(spec["batch_size"]),
            "--epochs", "100000", "--max-steps", str(spec["steps"]), "--out", str(out)]


def orchestrator_overrides(spec: dict) -> list[str]:
    return ["data=synthetic", f"data.rows={spec['rows']}", f"data.features={spec['features']}",
            f"data.classes={spec['classes']}", f"trainer.batch_size={spec['batch_size']}",
            "trainer.epochs=100000", f"trainer.max_steps={spec['steps']}",
            f"cluster.workers={spec['workers']}"]


def run(args: argparse.Namespace, work: Path) -> dict:
    spec = job(args)

    def orchestrated(i: int) -> dict:
        run_dir = work / f"orch-{i}"
        timed, watched = run_watched(orchestrator_cmd(run_dir, *orchestrator_overrides(spec)),
                                     work / f"orch-{i}.log", series=True)
        rec = read_json(run_dir / "run.json")
        first, rate = steady_window_start(rec), rec.get("samples_per_s")
        # The record keeps the rate since the first step; the window's end follows from it.
        last = first + (rec["steps"] - 1) * spec["batch_size"] / rate if first and rate else None
        return {"steady_samples_per_s": rate, "wall_s": timed.wall_s, "steps": rec.get("steps"),
                "checkpoints": len(rec.get("checkpoints", [])),
                "samples_per_worker_cpu_s": per_cpu_second(spec, watched["series"], first, last),
                "test_accuracy": rec.get("metrics", {}).get("test_accuracy")}

    def baseline(name: str, launcher: list[str]):
        def side(i: int) -> dict:
            out = work / f"{name}-{i}.json"
            timed, watched = run_watched([*launcher, *baseline_args(spec, out)],
                                         work / f"{name}-{i}.log", series=True)
            res = read_json(out)
            return {"steady_samples_per_s": res.get("steady_samples_per_s"),
                    "wall_s": timed.wall_s, "steps": res.get("steps"),
                    "samples_per_worker_cpu_s": per_cpu_second(
                        spec, watched["series"], res.get("first_step_at"), res.get("last_step_at")),
                    "test_accuracy": res.get("test_accuracy")}
        return side

    sides = {
        "orchestrator": orchestrated,
        "ray_train": baseline("ray_train", [PYTHON, str(BASELINES / "ray_train_ddp.py")]),
        "torchrun": baseline("torchrun", [PYTHON, "-m", "torch.distributed.run", "--standalone",
                                          "--nproc-per-node=2", str(BASELINES / "torchrun_ddp.py")]),
    }
    # The first run after anything else on this machine was 10-15% slower, whichever side it
    # was: a discarded run of the shortest side (torchrun) warms the machine up.
    for i in range(args.ddp_warmup):
        progress(f"ddp_throughput warm-up {i} (discarded): "
                 f"{sides['torchrun'](-1 - i)['steady_samples_per_s']} samples/s")
    runs = interleave(sides, args.repeats, log=lambda m: progress(f"ddp_throughput {m}"))
    return summarize(spec, runs)


def steady_window_start(record: dict) -> float | None:
    """When the run's (only) worker group finished its first step, in epoch seconds."""
    groups = record.get("world_sizes") or []
    if len(groups) != 1 or "first_step_at_s" not in groups[0]:
        return None
    return record["started_at"] + groups[0]["first_step_at_s"]


def per_cpu_second(spec: dict, series: dict, first: float | None, last: float | None):
    """Global samples per CPU-second of the training workers over the steady window (the
    first step's end to the last one's): the cost of a sample, which time-sharing a loaded
    machine's cores does not change the way it changes samples per wall-second."""
    if not first or not last or not series:
        return None
    used = cpu_between(series, first, last)
    return round((spec["steps"] - 1) * spec["batch_size"] / used, 1) if used > 0 else None


def summarize(spec: dict, runs: dict[str, list[dict]]) -> dict:
    rates = {name: [r["steady_samples_per_s"] for r in rs] for name, rs in runs.items()}
    medians = {name: median(v) for name, v in rates.items()}
    vs_ray = ratio(medians["orchestrator"], medians["ray_train"])
    vs_torchrun = ratio(medians["orchestrator"], medians["torchrun"])
    per_cpu = {name: median([r.get("samples_per_worker_cpu_s") for r in rs])
               for name, rs in runs.items()}
    return {
        "job": spec,
        "steady_samples_per_s": {name: v for name, v in rates.items()},
        "median_samples_per_s": medians,
        "paired_vs_ray_train": paired_ratios(rates["orchestrator"], rates["ray_train"]),
        "paired_vs_torchrun": paired_ratios(rates["orchestrator"], rates["torchrun"]),
        "figures": {
            "vs_ray_train": figure(vs_ray, GOAL_VS_RAY_TRAIN),
            "vs_torchrun": figure(vs_torchrun),
            "ray_train_vs_torchrun": figure(ratio(medians["ray_train"], medians["torchrun"])),
            "per_cpu_s_vs_ray_train": figure(ratio(per_cpu["orchestrator"], per_cpu["ray_train"])),
            "per_cpu_s_vs_torchrun": figure(ratio(per_cpu["orchestrator"], per_cpu["torchrun"])),
        },
        "median_samples_per_worker_cpu_s": per_cpu,
        "runs": runs,
    }
