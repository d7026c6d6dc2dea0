"""Pipeline parallelism (trainer.pipeline.degree), measured on the LM example.

Memory: peak resident memory (VmHWM) of the largest training worker at 4 workers, a deep
model (16 blocks of width 1024, ~202M parameters, AdamW: 16 bytes a parameter), cut into 4
stages (P=4, D=1) against DDP and FSDP (meta_init) at the same world size; the whole peak and
the peak above the worker's own baseline (the same job with a tiny model), as fsdp_memory.
Goal: P=4 <= 0.35 x DDP.

Bubble: the steady step time of a 2-stage pipeline (2 workers, 1 CPU each: stages that can
run at once on this 2-core machine; 4 stages on 2 cores would measure the CPU sharing, not
the schedule) against one worker running the whole model over the same micro-batches
(trainer.micro_batch_size, gradient accumulation: the same work per micro-batch). With
perfect overlap a stage is busy T1/P of a step; the measured bubble, 1 - (T1/P) / T_pipeline,
is compared with the schedule's ideal (P-1)/(M+P-1), for GPipe and 1F1B at M=4 and M=8.
It includes what the ideal leaves out: sending activations between the stages, and stages of
unequal work. Goal: within 1.5 x the ideal.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from scripts.benchmarks.common import Goal, figure, interleave, median, progress, ratio, read_json
from scripts.benchmarks.fsdp_memory import (
    EXAMPLE,
    TINY,
    above,
    big,
    example_cmd,
    overrides,
    worker_peak,
)
from scripts.benchmarks.memory import run_watched

MEMORY_GOAL = Goal("<=", 0.35)
BUBBLE_GOAL = Goal("<=", 1.5)
LAYERS = 16
BUBBLE_MODEL = ["trainer.model.dim=128", "trainer.model.layers=8", "trainer.model.heads=4"]
BUBBLE_BATCH = 32
STAGES = 2


def memory_runs(args: argparse.Namespace, work: Path) -> dict:
    model = big(args.pipeline_layers)
    runs = {"baseline": worker_peak(work, "baseline-4", overrides("ddp", 4, TINY, 2))}
    for name, extra in (("ddp", overrides("ddp", 4, model, args.fsdp_steps)),
                        ("fsdp", overrides("fsdp", 4, model, args.fsdp_steps)),
                        ("pipeline", [*overrides("ddp", 4, model, args.fsdp_steps),
                                      "trainer.pipeline.degree=4",
                                      "trainer.pipeline.microbatches=4"])):
        runs[name] = worker_peak(work, f"{name}-4", extra)
    return runs


def bubble_overrides(schedule: str | None, microbatches: int, steps: int) -> list[str]:
    common = ["+experiment=char_lm", *BUBBLE_MODEL, f"trainer.batch_size={BUBBLE_BATCH}",
              f"trainer.max_steps={steps}", "trainer.epochs=100", "checkpoint.every_steps=100000",
              "log.tensorboard=false", "cluster.cpus_per_worker=1"]
    if schedule is None:  # the whole model on one worker, the same micro-batches
        return [*common, "cluster.workers=1",
                f"trainer.micro_batch_size={BUBBLE_BATCH // microbatches}"]
    return [*common, f"cluster.workers={STAGES}", f"trainer.pipeline.degree={STAGES}",
            f"trainer.pipeline.schedule={schedule}", f"trainer.pipeline.microbatches={microbatches}"]


def step_time(work: Path, name: str, extra: list[str]) -> dict:
    run_dir = work / name
    timed, _ = run_watched(example_cmd(run_dir, *extra), work / f"{name}.log",
                           env={"PYTHONPATH": str(EXAMPLE)}, timeout=900)
    rec = read_json(run_dir / "run.json")
    rate = rec.get("samples_per_s")
    step_s = BUBBLE_BATCH / rate if rate else None
    progress(f"pipeline {name}: {step_s and round(step_s, 4)} s a step, {timed.wall_s} s")
    return {"step_s": step_s, "wall_s": timed.wall_s, "status": rec.get("status")}


def bubble_runs(args: argparse.Namespace, work: Path) -> dict[str, list[dict]]:
    sides = {}
    for m in (4, 8):
        for schedule in (None, "gpipe", "1f1b"):
            name = f"{schedule or 'one_worker'}@M{m}"
            extra = bubble_overrides(schedule, m, args.pipeline_steps)
            sides[name] = lambda i, name=name, extra=extra: step_time(work, f"{name}-{i}", extra)
    return interleave(sides, args.repeats, log=lambda m: progress(f"pipeline {m}"))


def run(args: argparse.Namespace, work: Path) -> dict:
    return summarize(memory_runs(args, work), bubble_runs(args, work), args.pipeline_layers)


def summarize(memory: dict, bubble: dict[str, list[dict]], layers: int = LAYERS) -> dict:
    base = memory["baseline"]["worker_max_mib"]
    peaks = {name: memory[name]["worker_max_mib"] for name in ("ddp", "fsdp", "pipeline")}
    figures = {
        "peak_rss_pipeline4_vs_ddp": figure(ratio(peaks["pipeline"], peaks["ddp"]), MEMORY_GOAL),
        "above_baseline_pipeline4_vs_ddp": figure(
            ratio(above(peaks["pipeline"], base), above(peaks["ddp"], base)), MEMORY_GOAL),
        "peak_rss_pipeline4_vs_fsdp4": figure(ratio(peaks["pipeline"], peaks["fsdp"])),
    }
    steps = {name: median([r["step_s"] for r in rs if r["step_s"]]) for name, rs in bubble.items()}
    for m in (4, 8):
        whole = steps.get(f"one_worker@M{m}")
        ideal = (STAGES - 1) / (m + STAGES - 1)
        for schedule in ("gpipe", "1f1b"):
            piped = steps.get(f"{schedule}@M{m}")
            measured = 1 - (whole / STAGES) / piped if whole and piped else None
            figures[f"bubble_{schedule}_M{m}"] = figure(
                ratio(measured, ideal), BUBBLE_GOAL, measured=measured and round(measured, 3),
                ideal=round(ideal, 3), step_s=piped and round(piped, 4),
                one_worker_step_s=whole and round(whole, 4))
    params_m = round(0.6 + 12.6 * layers)
    return {"job": {"memory": f"TinyGPT dim 1024, {layers} blocks (~{params_m}M parameters), AdamW, "
                              "4 workers: DDP, FSDP (meta_init), pipeline P=4 x D=1 (1F1B, M=4)",
                    "bubble": f"TinyGPT dim 128, 8 blocks, batch {BUBBLE_BATCH} x 64 bytes, "
                              f"P={STAGES} on {STAGES} workers of 1 CPU vs 1 worker of 1 CPU"},
            "figures": figures, "memory_runs": memory, "bubble_runs": bubble}
