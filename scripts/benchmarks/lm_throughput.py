"""The general PyTorch trainer's overhead on a real model: the LM example (examples/char_lm,
a 2-block byte-level transformer, 32 sequences of 64 bytes a step) on 1 worker against a
plain single-process torch loop of the same model and batch (scripts/baselines/plain_lm.py),
both with the same 2 threads, interleaved. Steady tokens/s: from the end of the first step to
the end of the last one."""

from __future__ import annotations

import argparse
from pathlib import Path

from scripts.benchmarks.common import (
    BASELINES,
    PYTHON,
    REPO,
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

GOAL = Goal(">=", 0.9)
TOKENS_PER_SAMPLE = 64


def orchestrator_overrides(args: argparse.Namespace) -> list[str]:
    return ["+experiment=char_lm", "cluster.workers=1", f"cluster.cpus_per_worker={args.lm_threads}",
            f"trainer.max_steps={args.lm_steps}", "trainer.epochs=100",
            "checkpoint.every_steps=100000", "log.tensorboard=false"]


def run(args: argparse.Namespace, work: Path) -> dict:
    example = REPO / "examples" / "char_lm"

    def orchestrated(i: int) -> dict:
        run_dir = work / f"orch-{i}"
        # The example's own config folder (a Hydra flag: before the overrides); its package
        # imports from PYTHONPATH, as from the example's folder.
        cmd = orchestrator_cmd(run_dir, *orchestrator_overrides(args))
        cmd[3:3] = ["-cd", str(example / "conf")]
        timed = run_timed(cmd, work / f"orch-{i}.log", env={"PYTHONPATH": str(example)})
        rec = read_json(run_dir / "run.json")
        rate = rec.get("samples_per_s")
        return {"steady_tokens_per_s": rate * TOKENS_PER_SAMPLE if rate else None,
                "wall_s": timed.wall_s, "steps": rec.get("steps"),
                "test_perplexity": rec.get("metrics", {}).get("test_perplexity")}

    def plain(i: int) -> dict:
        out = work / f"plain-{i}.json"
        timed = run_timed([PYTHON, str(BASELINES / "plain_lm.py"), "--steps", str(args.lm_steps),
                           "--threads", str(args.lm_threads), "--out", str(out)],
                          work / f"plain-{i}.log")
        res = read_json(out)
        return {"steady_tokens_per_s": res.get("steady_tokens_per_s"), "wall_s": timed.wall_s,
                "steps": res.get("steps")}

    runs = interleave({"orchestrator": orchestrated, "plain_torch": plain}, args.repeats,
                      log=lambda m: progress(f"lm_throughput {m}"))
    return summarize(args, runs)


def summarize(args: argparse.Namespace, runs: dict[str, list[dict]]) -> dict:
    rates = {name: [r["steady_tokens_per_s"] for r in rs] for name, rs in runs.items()}
    medians = {name: median(v) for name, v in rates.items()}
    return {
        "job": {"model": "TinyGPT dim 128, 2 blocks, 4 heads", "batch": "32 x 64 bytes",
                "steps": args.lm_steps, "threads": args.lm_threads, "workers": 1},
        "steady_tokens_per_s": rates,
        "median_tokens_per_s": medians,
        "paired_vs_plain_torch": paired_ratios(rates["orchestrator"], rates["plain_torch"]),
        "figures": {"vs_plain_torch": figure(ratio(medians["orchestrator"],
                                                   medians["plain_torch"]), GOAL)},
        "runs": runs,
    }
