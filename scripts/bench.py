"""The orchestrator's cost against raw Ray Train, torchrun and plain frameworks (issue 8).

    python scripts/bench.py all                  # every benchmark below, one JSON document
    python scripts/bench.py ddp_throughput --repeats 3 --markdown bench.md

Benchmarks (scripts/benchmarks/*.py; baselines in scripts/baselines/, each runnable alone):
  ddp_throughput  steady-state samples/s: orchestrator vs a plain Ray Train script and torchrun
  fixed_cost      a short job's command start to first step and to exit, vs plain Ray Train
  recovery        a worker kill to the next finished step, vs a cold start of the same job
  boosting        orchestrated XGBoost/LightGBM on 2 workers vs single-process train()
  memory          peak RSS of the driver and each worker, default job vs plain Ray Train
  lm_throughput   the LM example's tokens/s on 1 worker vs a plain single-process torch loop
  fsdp_memory     peak RSS per worker, FSDP vs DDP, 2 and 4 workers, ~101M-parameter transformer
                  (--fsdp-layers 16: ~202M)
  fsdp_checkpoint a ~1.2 GiB sharded checkpoint to S3: async vs sync blocking, upload rate, memory
  data_scale      parquet of ~1 and ~8 GiB streamed by 2 workers: peak RSS, bytes read, samples/s
  shuffle_window  streamed digits (a window shuffle) vs held in memory (a full shuffle): accuracy
  script_vs_torchrun  a user's torchrun script under trainer=script vs plain torchrun: wall
                  time, the same final weights
  pipeline        peak RSS per worker, pipeline P=4 vs DDP and FSDP at 4 workers (~202M
                  parameters); the pipeline bubble of GPipe and 1F1B at M=4 and 8 vs the ideal
  ps              samples/s with one of 4 workers stopped a while: asynchronous trainer=tf_ps vs
                  synchronous trainer=mwms (the speed each keeps)
  scale           the control plane at 16-1,024 simulated ranks against a real S3 server: one
                  checkpoint's commit after the last part, its requests; run.json after 1,000
                  attempts; the preemption agreement after a notice (not part of `all`;
                  --scale-parts runs some)

Every comparison runs its sides in the same run, interleaved (A B, then B A, ...), and reports
ratios of medians: the machine is shared and noisy, absolute times mean little. The load
average at start and end is in the JSON. Prints the JSON on stdout and writes a Markdown
summary (--markdown).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.benchmarks.common import loadavg, progress  # noqa: E402
from scripts.benchmarks.report import markdown  # noqa: E402

BENCHMARKS = ("ddp_throughput", "fixed_cost", "recovery", "boosting", "memory", "lm_throughput",
              "fsdp_memory", "fsdp_checkpoint", "data_scale", "shuffle_window", "script_vs_torchrun",
              "pipeline", "ps")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=(*BENCHMARKS, "scale", "all"))
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats per benchmark")
    p.add_argument("--markdown", default="bench.md", help="where to write the Markdown summary")
    p.add_argument("--json", default=None, help="also write the JSON here")
    p.add_argument("--workdir", default=None, help="keep logs and run folders here")
    g = p.add_argument_group("sizes")
    g.add_argument("--ddp-rows", type=int, default=100_000)
    g.add_argument("--ddp-batch", type=int, default=512, help="global batch (per worker: /2)")
    g.add_argument("--ddp-steps", type=int, default=6000,
                   help="a long steady window: this shared machine's speed drifts by 20%%")
    g.add_argument("--ddp-warmup", type=int, default=1, help="discarded runs before DDP's")
    g.add_argument("--fixed-epochs", type=int, default=10,
                   help="digits epochs of the short job (10: the default job)")
    g.add_argument("--fixed-variants", default="",
                   help="comma-separated orchestrator variants (fixed_cost.VARIANTS: "
                        "no_dashboard, mwms, no_speed_hooks, no_train_page, and no_<hook> "
                        "for each speed hook: no_callbacks, no_barrier, no_autoscaling, "
                        "no_started_ahead, no_spares, no_fork_server; each also joining the "
                        "warm head), or ''; with --fixed-tree, on that checkout too")
    g.add_argument("--fixed-tree", default=None,
                   help="another checkout of this repository (e.g. a git worktree of an older "
                        "commit) as an extra side, orchestrator_tree: its driver and Ray Train "
                        "controller run that code (PYTHONPATH first, PYTHONSAFEPATH=1); the "
                        "workers still import this checkout's trainers; recovery runs its job "
                        "with it too, right after its own, each repeat; fixed_cost's sweep "
                        "runs its sweep too, interleaved with this tree's, --repeats pairs")
    g.add_argument("--fixed-warm", type=int, default=1,
                   help="fixed_cost: also time commands joining a running cluster (0: skip)")
    g.add_argument("--fixed-served", type=int, default=1,
                   help="fixed_cost: also time commands run by a service kept alive "
                        "(cluster.keep_alive) on an embedded Ray (0: skip)")
    g.add_argument("--sweep-trials", type=int, default=4,
                   help="also time a sweep of N trials in one Ray session (0: skip)")
    g.add_argument("--recovery-kill-step", type=int, default=120)
    g.add_argument("--recovery-checkpoint-every", type=int, default=50)
    g.add_argument("--recovery-rank", type=int, default=1)
    g.add_argument("--recovery-spare-after-s", type=lambda v: None if v == "none" else float(v),
                   default=2.0, help="recovery's failure.spare_after_s ('none': no process "
                   "kept ready); the kill waits until they are ready")
    g.add_argument("--recovery-kill-after-s", type=float, default=8.0,
                   help="recovery: every side's kill at least this long after its first step")
    g.add_argument("--boost-rows", type=int, default=1_000_000)
    g.add_argument("--boost-frameworks", default="xgboost,lightgbm")
    g.add_argument("--boost-repeats", type=int, default=1,
                   help="repeats for boosting (its 1M-row runs are the longest)")
    g.add_argument("--lm-steps", type=int, default=300)
    g.add_argument("--lm-threads", type=int, default=2, help="both sides' torch threads")
    g.add_argument("--fsdp-steps", type=int, default=3,
                   help="steps of the ~101M-parameter runs (checkpoints: every N of 4N steps)")
    g.add_argument("--pipeline-layers", type=int, default=16,
                   help="pipeline's memory model: blocks of width 1024 (16: ~202M parameters)")
    g.add_argument("--pipeline-steps", type=int, default=20,
                   help="pipeline's bubble runs: steps of the 8-block model")
    g.add_argument("--ps-stop-s", type=float, default=20.0,
                   help="ps: how long one worker is stopped (SIGSTOP)")
    g.add_argument("--ps-window-s", type=float, default=15.0,
                   help="ps: the windows before and after the stop")
    g.add_argument("--ps-warm-steps", type=int, default=100,
                   help="ps: steps before the first window")
    g.add_argument("--fsdp-layers", type=int, default=8,
                   help="fsdp_memory's blocks of width 1024 (8: ~101M parameters, 16: ~202M)")
    g.add_argument("--data-gib", default="1,8", help="data_scale's dataset sizes on disk")
    g.add_argument("--data-dir", default=None, help="where data_scale writes (and reuses) them")
    g.add_argument("--data-steps", type=int, default=3000,
                   help="steps of the runs compared for samples/s (--repeats pairs)")
    g.add_argument("--data-batch", type=int, default=1024)
    g.add_argument("--data-parts", default="torch,boosting",
                   help="data_scale's legs: torch (the PyTorch trainer), boosting; or reads "
                        "alone (the reader vs a bare pyarrow read)")
    g.add_argument("--data-boosters", default="xgboost,xgboost_external,lightgbm",
                   help="data_scale's boosting legs on the largest dataset")
    g.add_argument("--data-boost-rounds", type=int, default=5)
    g.add_argument("--script-epochs", type=int, default=20, help="script_vs_torchrun's epochs")
    g.add_argument("--shuffle-window", type=int, default=1, help="shuffle_window's data.window")
    g.add_argument("--shuffle-seeds", type=int, default=3, help="shuffle_window's seeds")
    g.add_argument("--scale-sizes", type=lambda v: tuple(int(n) for n in v.split(",")),
                   default=(16, 64, 256, 1024), help="scale's simulated ranks")
    g.add_argument("--scale-parts", type=lambda v: tuple(v.split(",")),
                   default=("checkpoint", "probe", "record", "recorder", "agreement"),
                   help="scale's parts: checkpoint, probe, record, recorder, agreement")
    return p


def machine() -> dict:
    import ray
    import torch

    mem_kb = int(Path("/proc/meminfo").read_text().split()[1])  # MemTotal
    return {"cpus": os.cpu_count(), "memory_gib": round(mem_kb / 2**20, 1),
            "gpu": False, "python": platform.python_version(), "ray": ray.__version__,
            "torch": torch.__version__, "platform": platform.platform()}


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    args.fixed_variants = [v for v in args.fixed_variants.split(",") if v]
    args.boost_frameworks = [f for f in args.boost_frameworks.split(",") if f]
    args.data_parts = [p for p in args.data_parts.split(",") if p]
    args.data_boosters = [b for b in args.data_boosters.split(",") if b]
    names = BENCHMARKS if args.name == "all" else (args.name,)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-")).resolve()
    doc = {"command": "python scripts/bench.py " + " ".join(argv or sys.argv[1:]),
           "date": datetime.date.today().isoformat(), "machine": machine(),
           "loadavg_start": loadavg(), "repeats": args.repeats, "workdir": str(root),
           "benchmarks": {}}
    started = time.time()
    for name in names:
        progress(f"{name}: starting (load {loadavg()})")
        work = root / name
        work.mkdir(parents=True, exist_ok=True)
        module = importlib.import_module(f"scripts.benchmarks.{name}")
        repeats = args.repeats
        if name == "boosting" and args.boost_repeats:
            args.repeats = args.boost_repeats
        begun = time.time()
        try:
            shared = doc["benchmarks"].get("fixed_cost", {}).get("runs")
            if name == "memory" and shared:  # the same runs, read for their memory
                result = module.from_runs(shared)
            else:
                result = module.run(args, work)
        except Exception as exc:  # one benchmark failing leaves the others' figures
            result = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
        finally:
            args.repeats = repeats
        result["elapsed_s"] = round(time.time() - begun, 1)
        result["loadavg_end"] = loadavg()
        doc["benchmarks"][name] = result
        progress(f"{name}: done in {result['elapsed_s']}s")
    doc["elapsed_s"] = round(time.time() - started, 1)
    doc["loadavg_end"] = loadavg()
    text = json.dumps(doc, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(doc))
    return doc


if __name__ == "__main__":
    main()
