"""Benchmark: a 4-trial parallelism sweep against the same four runs as separate commands.

    python scripts/bench_sweep.py [--workers 1,2,3,4] [--epochs 2] [--repeats 1]

Both sides use an embedded local Ray, the same data and config, on this machine in one go
(sweep first, then the commands; with --repeats N the order alternates). Prints JSON; the
goal is sweep_s / sequential_s <= 0.6.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.local_cluster import clean_env  # noqa: E402


def timed(cmd: list[str]) -> float:
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def sweep_once(py: list[str], tmp: str, i: int, workers: str, common: list[str]) -> float:
    return timed([*py, "--multirun", f"cluster.workers={workers}",
                  f"hydra.sweep.dir={tmp}/sweep-{i}", *common])


def commands_once(py: list[str], tmp: str, i: int, workers: str, common: list[str]) -> float:
    return sum(timed([*py, f"cluster.workers={w}", f"hydra.run.dir={tmp}/run-{i}-{w}",
                      f"run.name=seq-{i}-{w}", *common]) for w in workers.split(","))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", default="1,2,3,4")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    py = [sys.executable, "-m", "orchestrator"]
    sweeps, sequentials = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            common = [f"trainer.epochs={args.epochs}", f"storage.uri={tmp}/ckpt-{i}"]
            if i % 2:  # alternate the order, so that neither side always runs on a warmer machine
                sequentials.append(commands_once(py, tmp, i, args.workers, common))
                sweeps.append(sweep_once(py, tmp, i, args.workers, common))
            else:
                sweeps.append(sweep_once(py, tmp, i, args.workers, common))
                sequentials.append(commands_once(py, tmp, i, args.workers, common))
    ratios = [a / b for a, b in zip(sweeps, sequentials, strict=True)]
    print(json.dumps({"trials": len(args.workers.split(",")), "workers": args.workers,
                      "epochs": args.epochs, "sweep_s": [round(s, 1) for s in sweeps],
                      "sequential_s": [round(s, 1) for s in sequentials],
                      "sweep_vs_sequential": round(sorted(ratios)[len(ratios) // 2], 3),
                      "goal": 0.6}))


if __name__ == "__main__":
    main()
