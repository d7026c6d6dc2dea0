"""Models larger than one worker: peak resident memory (VmHWM) per training worker, FSDP
against DDP, at 2 and 4 workers, on a ~101M-parameter transformer (the LM example widened:
8 blocks of width 1024, or --fsdp-layers N: ~202M at 16; AdamW, so parameters + gradients +
2 moments = 16 bytes a parameter).

Both figures are reported: the whole peak RSS of the largest worker, and its peak above the
worker's own baseline (the same job with a tiny model: Python, torch, Ray and the data, ~0.5
GiB here), which is what the sharding divides. FSDP builds the model on the meta device
(trainer.fsdp.meta_init), so no worker ever holds the whole model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from scripts.benchmarks.common import (
    REPO,
    Goal,
    figure,
    orchestrator_cmd,
    progress,
    ratio,
    read_json,
)
from scripts.benchmarks.memory import run_watched

EXAMPLE = REPO / "examples" / "char_lm"
GOALS = {2: Goal("<=", 0.6), 4: Goal("<=", 0.35)}


def big(layers: int) -> list[str]:
    """The widened LM example with ``layers`` blocks (~12.6M parameters each)."""
    return ["trainer.model.dim=1024", f"trainer.model.layers={layers}", "trainer.model.heads=16"]


BIG = big(8)  # ~101M parameters
TINY = ["trainer.model.dim=32", "trainer.model.layers=1", "trainer.model.heads=2"]


def overrides(parallel: str, workers: int, model: list[str], steps: int) -> list[str]:
    sharded = ["trainer=fsdp", "trainer.fsdp.meta_init=true"] if parallel == "fsdp" else []
    # Both with freed memory returned to the OS (FSDP's default on CPU): the same allocator.
    return ["+experiment=char_lm", *sharded, *model, f"cluster.workers={workers}",
            "trainer.release_host_memory=true",
            "trainer.batch_size=8", f"trainer.max_steps={steps}", "trainer.epochs=100",
            "checkpoint.every_steps=100000", "log.tensorboard=false", "log.metrics=false"]


def example_cmd(run_dir: Path, *extra: str) -> list[str]:
    """The LM example's command, its own config folder a Hydra flag before the overrides."""
    cmd = orchestrator_cmd(run_dir, *extra)
    cmd[3:3] = ["-cd", str(EXAMPLE / "conf")]
    return cmd


def worker_peak(work: Path, name: str, extra: list[str]) -> dict:
    run_dir = work / name
    timed, peaks = run_watched(example_cmd(run_dir, *extra), work / f"{name}.log",
                               env={"PYTHONPATH": str(EXAMPLE)}, timeout=1800)
    rec = read_json(run_dir / "run.json")
    workers = peaks["train_workers_mib"]
    progress(f"fsdp_memory {name}: workers {workers} MiB, {timed.wall_s} s")
    return {"worker_max_mib": max(workers) if workers else None, "workers_mib": workers,
            "wall_s": timed.wall_s, "steps": rec.get("steps"), "status": rec.get("status")}


def run(args: argparse.Namespace, work: Path) -> dict:
    runs: dict[str, dict] = {}
    for workers in (2, 4):
        runs[f"baseline@{workers}"] = worker_peak(work, f"baseline-{workers}",
                                                  overrides("ddp", workers, TINY, 2))
        for parallel in ("ddp", "fsdp"):
            runs[f"{parallel}@{workers}"] = worker_peak(
                work, f"{parallel}-{workers}",
                overrides(parallel, workers, big(args.fsdp_layers), args.fsdp_steps))
    return summarize(runs, args.fsdp_layers)


def above(peak: float | None, baseline: float | None) -> float | None:
    return peak - baseline if peak is not None and baseline is not None else None


def summarize(runs: dict[str, dict], layers: int = 8) -> dict:
    figures = {}
    for workers in (2, 4):
        base = runs[f"baseline@{workers}"]["worker_max_mib"]
        ddp, fsdp = runs[f"ddp@{workers}"]["worker_max_mib"], runs[f"fsdp@{workers}"]["worker_max_mib"]
        figures[f"peak_rss_fsdp_vs_ddp_at_{workers}"] = figure(ratio(fsdp, ddp), GOALS[workers])
        figures[f"above_baseline_fsdp_vs_ddp_at_{workers}"] = figure(
            ratio(above(fsdp, base), above(ddp, base)), GOALS[workers])
    params_m = round(0.6 + 12.6 * layers)  # embeddings and head, then 12.6M a block
    return {"job": {"model": f"TinyGPT dim 1024, {layers} blocks, 16 heads (~{params_m}M parameters)",
                    "optimizer": "AdamW", "global_batch": "8 x 64 bytes", "fsdp": "meta_init",
                    "release_host_memory": True},
            "figures": figures, "runs": runs}
