"""A user's unchanged torchrun script (tests/user_project/scripts/ddp_snapshot.py, 2 ranks,
a snapshot every epoch) run by plain torchrun and by `trainer=script` with the same torchrun
command line, interleaved: command to exit, and whether both end with the same weights."""

from __future__ import annotations

import argparse
import io
import shutil
from pathlib import Path

from scripts.benchmarks.common import (
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
    run_timed,
)

PROJECT = REPO / "tests" / "user_project"
SCRIPT = "scripts/ddp_snapshot.py"
TORCHRUN = str(Path(PYTHON).parent / "torchrun")
GOAL = Goal("<=", 2.0)  # issue 30's bound for a cold start against torchrun's


def run(args: argparse.Namespace, work: Path) -> dict:
    epochs = args.script_epochs
    line = f"--nproc-per-node=2 {SCRIPT} {epochs} 1"

    def torchrun(i: int) -> dict:
        folder = work / f"torchrun-{i}"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(PROJECT, folder, ignore=shutil.ignore_patterns("__pycache__"))
        timed = run_timed([TORCHRUN, *line.split()], work / f"torchrun-{i}.log",
                          cwd=folder)
        return {"to_exit_s": timed.wall_s, "weights": weights((folder / "snapshot.pt").read_bytes())}

    def orchestrated(i: int) -> dict:
        run_dir = work / f"orchestrator-{i}"
        timed = run_timed(orchestrator_cmd(run_dir, "trainer=script",
                                           f"trainer.workdir={PROJECT}",
                                           "trainer.checkpoint_files=[snapshot.pt]",
                                           f"trainer.command=torchrun {line}",
                                           "cluster.dashboard=false", "log.progress=off"),
                          work / f"orchestrator-{i}.log")
        return {"to_exit_s": timed.wall_s, "weights": newest_snapshot(run_dir / "ckpt")}

    runs = interleave({"orchestrator": orchestrated, "torchrun": torchrun}, args.repeats,
                      log=lambda m: progress(f"script_vs_torchrun {m}"))
    ours = [r["to_exit_s"] for r in runs["orchestrator"]]
    theirs = [r["to_exit_s"] for r in runs["torchrun"]]
    same = [equal(a["weights"], b["weights"])
            for a, b in zip(runs["orchestrator"], runs["torchrun"], strict=True)]
    for side in runs.values():
        for r in side:
            r.pop("weights")
    return {
        "spec": {"script": SCRIPT, "epochs": epochs, "ranks": 2,
                 "command": f"torchrun {line}"},
        "runs": runs,
        "medians": {"orchestrator_to_exit_s": median(ours), "torchrun_to_exit_s": median(theirs)},
        "figures": {
            "to_exit_ratio": figure(ratio(median(ours), median(theirs)), GOAL,
                                    pairs=paired_ratios(ours, theirs)),
            "same_final_weights": figure(all(same), pairs=same),
        },
    }


def weights(data: bytes) -> dict:
    import torch

    return torch.load(io.BytesIO(data))["MODEL_STATE"]


def newest_snapshot(storage: Path) -> dict:
    """The final committed checkpoint's snapshot.pt (the run's folder under storage)."""
    from orchestrator.checkpoint.store import CheckpointStore
    from orchestrator.storage.location import StorageSpec

    (run_folder,) = [p for p in storage.iterdir() if p.is_dir()]
    store = CheckpointStore(StorageSpec(str(run_folder)))
    files, _ = store.load(store.latest())
    return weights(files["node_0/work/snapshot.pt"])


def equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
