"""Fixed cost of a short job: command start to first finished step and to exit, the
orchestrator against the plain Ray Train script (scripts/baselines/ray_train_ddp.py) on the
same short DDP job (the default job: digits, 10 epochs, 220 steps), interleaved. Each run's
process tree is polled for memory (scripts/benchmarks/memory.py reads it). Optional variants of
the orchestrator (other settings) run as extra sides; with --sweep-trials, a sweep's cost per
trial (one Ray session for all)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from orchestrator.ray_internals.versions import HOOK_NAMES, SPEED_HOOKS_OFF
from scripts.benchmarks.common import (
    BASELINES,
    ORCHESTRATOR,
    PYTHON,
    REPO,
    Goal,
    figure,
    first_step_at,
    interleave,
    median,
    orchestrator_cmd,
    paired_ratios,
    progress,
    ratio,
    read_json,
    run_timed,
)
from scripts.benchmarks.memory import run_watched

GOAL = Goal("<=", 1.0)
TORCHRUN_GOAL = Goal("<=", 2.0)
WARM_TORCHRUN_GOAL = Goal("<=", 1.3)
# Orchestrator settings worth measuring against the default: name -> (overrides, environment).
VARIANTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "no_dashboard": (["cluster.dashboard=false"], {}),
    "mwms": (["trainer=mwms"], {}),  # the same job under TensorFlow's MultiWorkerMirroredStrategy
    # What the speed hooks into Ray's private code buy (orchestrator/ray_internals/versions.py:
    # what a Ray or torch outside the tested range gets); also timed joining the warm head.
    "no_speed_hooks": ([], {"ORCHESTRATOR_SPEED_HOOKS": "0"}),
    # What the dashboard's Train page (Ray Train's state tracking, on by default) costs.
    "no_train_page": (["cluster.dashboard_train_page=false"], {}),
    # Each speed hook the driver chooses, off alone (ray_internals/versions.py HOOK_NAMES).
    **{f"no_{name}": ([], {SPEED_HOOKS_OFF: name}) for name in HOOK_NAMES},
}


def run(args: argparse.Namespace, work: Path) -> dict:
    epochs = args.fixed_epochs
    spec = {"data": "digits", "epochs": epochs, "steps": 22 * epochs, "batch_size": 64,
            "workers": 2}

    def orchestrated(name: str, overrides: list[str], env: dict[str, str], tree: str | None = None):
        """A side; with ``tree``, an older checkout's code. Run from its folder: Ray puts the
        driver's folder first on its processes' sys.path, so from this repository the old
        driver's controller, recorder and workers would import this tree's modules."""
        def side(i: int) -> dict:
            run_dir = work / f"{name}-{i}"
            timed, peaks = run_watched(
                orchestrator_cmd(run_dir, f"trainer.epochs={epochs}", *overrides),
                work / f"{name}-{i}.log", env=env, cwd=Path(tree) if tree else REPO)
            rec = read_json(run_dir / "run.json")
            return {"to_exit_s": timed.wall_s,
                    "to_first_step_s": round(first_step_at(rec) - timed.started_at, 3),
                    "steps": rec.get("steps"), "memory": peaks}
        return side

    def baseline(name: str, command: list[str]):
        """A baseline script that writes its first step's time to --out."""
        def side(i: int) -> dict:
            out = work / f"{name}-{i}.json"
            timed, peaks = run_watched([*command, "--epochs", str(epochs), "--out", str(out)],
                                       work / f"{name}-{i}.log")
            res = read_json(out)
            return {"to_exit_s": timed.wall_s,
                    "to_first_step_s": round(res["first_step_at"] - timed.started_at, 3),
                    "steps": res.get("steps"), "memory": peaks}
        return side

    ray_train = baseline("ray_train", [PYTHON, str(BASELINES / "ray_train_ddp.py")])
    torchrun = baseline("torchrun", [PYTHON, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc-per-node=2", str(BASELINES / "torchrun_ddp.py")])

    sides = {"orchestrator": orchestrated("orchestrator", [], {}), "ray_train": ray_train,
             "torchrun": torchrun}
    tree = getattr(args, "fixed_tree", None)
    tree_env = {"PYTHONSAFEPATH": "1", "PYTHONPATH": tree} if tree else {}
    for name in args.fixed_variants:
        overrides, env = VARIANTS[name]
        sides[f"orchestrator_{name}"] = orchestrated(f"orchestrator_{name}", overrides, env)
        if tree:  # the variant on the older checkout too
            sides[f"orchestrator_tree_{name}"] = orchestrated(
                f"orchestrator_tree_{name}", overrides, {**env, **tree_env}, tree)
    if tree:  # an older checkout's driver, side by side
        sides["orchestrator_tree"] = orchestrated("orchestrator_tree", [], tree_env, tree)
    head = None
    if args.fixed_warm:  # the second command: a cluster already running (`ray start --head`)
        from scripts.local_cluster import start_head

        (work / "warm-head").mkdir(exist_ok=True)
        head = start_head(work / "warm-head")
        sides["orchestrator_warm"] = orchestrated(
            "orchestrator_warm", [f"cluster.address={head.address}"], {})
        for name in args.fixed_variants:  # each variant joining it too
            overrides, env = VARIANTS[name]
            sides[f"orchestrator_warm_{name}"] = orchestrated(
                f"orchestrator_warm_{name}", [*overrides, f"cluster.address={head.address}"], env)
        if tree:  # the older checkout's driver joining it too
            sides["orchestrator_tree_warm"] = orchestrated(
                "orchestrator_tree_warm", [f"cluster.address={head.address}"], tree_env, tree)
    served_env = {"ORCHESTRATOR_SERVICE_DIR": str(work / "svc")}
    first_served = None
    if getattr(args, "fixed_served", 0):  # a service kept alive (cluster.keep_alive) on an embedded Ray
        keep = ["cluster.keep_alive=600"]
        first_served = orchestrated("orchestrator_served_first", keep, served_env)(0)
        command = orchestrated("orchestrator_served", keep, served_env)

        def served(i: int) -> dict:
            wait_service_ready(served_env)  # what it starts between commands: not timed
            return command(i)

        sides["orchestrator_served"] = served
    try:
        runs = interleave(sides, args.repeats, log=lambda m: progress(f"fixed_cost {m}"))
    finally:
        if first_served is not None:
            stop_service(served_env)
        if head is not None:
            from scripts.local_cluster import stop_cluster

            stop_cluster(head)
    result = summarize(spec, runs)
    if first_served is not None:
        result["served_first_command"] = first_served
    if args.sweep_trials:
        result["sweep"] = sweep_cost(args, work, epochs, result)
    return result


def service_command(env: dict[str, str], command: str) -> str:
    import subprocess

    done = subprocess.run([PYTHON, "-m", "orchestrator.service", command], cwd=REPO,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    return done.stdout


def wait_service_ready(env: dict[str, str], timeout_s: float = 120) -> None:
    """Until the service has started the processes for the next command (as a user who reads
    the last command's output first would find it)."""
    import json
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = service_command(env, "status")
        if out and not json.loads(out)["preparing"]:
            return
        time.sleep(0.5)


def stop_service(env: dict[str, str]) -> None:
    service_command(env, "stop")


def summarize(spec: dict, runs: dict[str, list[dict]]) -> dict:
    def med(side: str, key: str) -> float | None:
        return median([r[key] for r in runs[side]])

    medians = {side: {key: med(side, key) for key in ("to_exit_s", "to_first_step_s")}
               for side in runs}
    figures = {}
    for key in ("to_exit_s", "to_first_step_s"):
        figures[f"{key}_vs_ray_train"] = figure(
            ratio(medians["orchestrator"][key], medians["ray_train"][key]), GOAL,
            paired=paired_ratios([r[key] for r in runs["orchestrator"]],
                                 [r[key] for r in runs["ray_train"]]))
        for side in runs:
            if side.startswith("orchestrator_"):
                figures[f"{key}_{side.removeprefix('orchestrator_')}_vs_ray_train"] = figure(
                    ratio(medians[side][key], medians["ray_train"][key]), GOAL)
        if "torchrun" in runs:  # issue 30: a cold start <= 2x torchrun's, a warm one <= 1.3x
            for side, goal, name in (("orchestrator", TORCHRUN_GOAL, ""),
                                     ("orchestrator_warm", WARM_TORCHRUN_GOAL, "warm_"),
                                     ("orchestrator_served", WARM_TORCHRUN_GOAL, "served_")):
                if side in runs:
                    figures[f"{key}_{name}vs_torchrun"] = figure(
                        ratio(medians[side][key], medians["torchrun"][key]),
                        goal if key == "to_exit_s" else None,
                        paired=paired_ratios([r[key] for r in runs[side]],
                                             [r[key] for r in runs["torchrun"]]))
    profile = cpu_profile(runs)
    if profile:  # CPU seconds: what a loaded machine blurs least (wall time is mostly waiting)
        figures["cpu_s_vs_ray_train"] = figure(
            ratio(profile["orchestrator"]["total"], profile["ray_train"]["total"]),
            paired=paired_ratios([r["memory"]["cpu_s"] for r in runs["orchestrator"]],
                                 [r["memory"]["cpu_s"] for r in runs["ray_train"]]))
    return {"job": spec, "median_s": medians, "figures": figures, "cpu_s_profile": profile,
            "runs": runs}


def cpu_profile(runs: dict[str, list[dict]]) -> dict:
    """Median CPU seconds per process title (the driver, each Ray actor class, Ray's own
    processes) for each side: where a short job's cost goes."""
    if not all("memory" in r and "cpu_s_by_title" in r["memory"] for rs in runs.values()
               for r in rs):
        return {}
    out = {}
    for side, rs in runs.items():
        titles = sorted({t for r in rs for t in r["memory"]["cpu_s_by_title"]})
        out[side] = {t: median([r["memory"]["cpu_s_by_title"].get(t, 0.0) for r in rs])
                     for t in titles}
        out[side]["total"] = median([r["memory"]["cpu_s"] for r in rs])
    return out


def sweep_cost(args: argparse.Namespace, work: Path, epochs: int, result: dict) -> dict:
    """A sweep of N trials one at a time in one Ray session: its wall time per trial against
    a single command's (the same job), from this run's medians. With --fixed-tree, the older
    checkout's sweep too, interleaved with this tree's, --repeats pairs."""
    n = args.sweep_trials
    tree = getattr(args, "fixed_tree", None)
    lrs = ",".join(f"{0.1 + 0.001 * k:.3f}" for k in range(n))

    def sweep(label: str, i: int, cwd: Path, env: dict | None) -> float:
        sweep_dir = work / f"sweep-{label}-{i}"
        progress(f"fixed_cost sweep of {n} trials ({label} {i + 1})")
        timed = run_timed([*ORCHESTRATOR, "--multirun", f"trainer.lr={lrs}",
                           f"trainer.epochs={epochs}", f"hydra.sweep.dir={sweep_dir}",
                           f"storage.uri={sweep_dir / 'ckpt'}", "hydra.sweeper.max_concurrent=1"],
                          work / f"sweep-{label}-{i}.log", env=env, cwd=cwd)
        return timed.wall_s

    ours, older = [], []
    for i in range(args.repeats if tree else 1):
        ours.append(sweep("ours", i, REPO, None))
        if tree:
            older.append(sweep("tree", i, Path(tree), {"PYTHONSAFEPATH": "1", "PYTHONPATH": tree}))
    single = result["median_s"]["orchestrator"]["to_exit_s"]
    wall = median(ours)
    per_trial = wall / n
    out = {"trials": n, "wall_s": wall, "per_trial_s": round(per_trial, 3),
           "figure": figure(ratio(per_trial, result["median_s"]["ray_train"]["to_exit_s"]),
                            GOAL, what="sweep wall / trials, against one plain Ray Train run"),
           "vs_single_command": ratio(per_trial, single)}
    if tree:
        out["runs_s"] = ours
        out["tree"] = {"runs_s": older, "wall_s": median(older),
                       "paired": [ratio(a, b) for a, b in zip(ours, older, strict=True)]}
    return out
