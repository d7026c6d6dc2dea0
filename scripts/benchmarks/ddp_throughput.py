"""DDP steady-state throughput: the orchestrator against a plain Ray Train TorchTrainer script
and against torchrun with plain torch.distributed (gloo), the same model, data and per-worker
batch, interleaved. Steady state: global samples/s from the end of the first step to the end of
the last one (the orchestrator's `steady_samples_per_s` in run.json), on a run of many steps."""

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
    run_timed,
)

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
        timed = run_timed(orchestrator_cmd(run_dir, *orchestrator_overrides(spec)),
                          work / f"orch-{i}.log")
        rec = read_json(run_dir / "run.json")
        return {"steady_samples_per_s": rec.get("steady_samples_per_s"), "wall_s": timed.wall_s,
                "steps": rec.get("steps"), "checkpoints": len(rec.get("checkpoints", [])),
                "test_accuracy": rec.get("metrics", {}).get("test_accuracy")}

    def baseline(name: str, launcher: list[str]):
        def side(i: int) -> dict:
            out = work / f"{name}-{i}.json"
            timed = run_timed([*launcher, *baseline_args(spec, out)], work / f"{name}-{i}.log")
            res = read_json(out)
            return {"steady_samples_per_s": res.get("steady_samples_per_s"),
                    "wall_s": timed.wall_s, "steps": res.get("steps"),
                    "test_accuracy": res.get("test_accuracy")}
        return side

    sides = {
        "orchestrator": orchestrated,
        "ray_train": baseline("ray_train", [PYTHON, str(BASELINES / "ray_train_ddp.py")]),
        "torchrun": baseline("torchrun", [PYTHON, "-m", "torch.distributed.run", "--standalone",
                                          "--nproc-per-node=2", str(BASELINES / "torchrun_ddp.py")]),
    }
    runs = interleave(sides, args.repeats, log=lambda m: progress(f"ddp_throughput {m}"))
    return summarize(spec, runs)


def summarize(spec: dict, runs: dict[str, list[dict]]) -> dict:
    rates = {name: [r["steady_samples_per_s"] for r in rs] for name, rs in runs.items()}
    medians = {name: median(v) for name, v in rates.items()}
    vs_ray = ratio(medians["orchestrator"], medians["ray_train"])
    vs_torchrun = ratio(medians["orchestrator"], medians["torchrun"])
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
        },
        "runs": runs,
    }
