"""Chaos: one job on a local multi-node Ray cluster, faults injected at seeded random steps.

    python scripts/chaos.py --trainer ddp --faults 10 --seed 0
    python scripts/chaos.py --trainer xgboost --faults 10 --seed 0

Fault kinds: worker_kill (SIGKILL a training worker), node_kill (SIGKILL a node's processes),
preemption (SIGTERM a node: Ray drains it with a deadline), hang (SIGSTOP a worker). A killed or
preempted node is replaced by a new one. Prints JSON: per fault its kind, the step it hit, the
recovery time (fault to the next completed step) and the steps lost; then the run's final
metric against a fault-free run of the same job on the same cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.local_cluster import (  # noqa: E402
    add_node,
    clean_env,
    node_of,
    start_head,
    stop_cluster,
    stop_head,
)

KINDS = ("worker_kill", "node_kill", "preemption", "hang")
JOBS = {
    "ddp": (["trainer=ddp", "trainer.epochs=900", "checkpoint.every_steps=500"], "test_accuracy"),
    # Rounds of ~20-40 ms: the last fault (at 90% of the rounds) still finds the job running
    # when a preemption notice arrives (Ray polls drains every 5 s).
    "xgboost": (["trainer=xgboost", "data=synthetic", "data.rows=200000", "trainer.max_depth=4",
                 "trainer.eta=0.05", "trainer.num_boost_round=1500", "checkpoint.every_steps=20"],
                "test_auc"),
}


def read(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def wait(run_dir: Path, predicate, proc: subprocess.Popen, timeout: float = 600) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        rec = read(run_dir)
        if rec and predicate(rec):
            return rec
        time.sleep(0.1)
    return read(run_dir)


def launch(run_dir: Path, address: str, storage: Path, overrides: list[str], name: str):
    cmd = [sys.executable, "-m", "orchestrator", f"hydra.run.dir={run_dir}",
           f"cluster.address={address}", f"storage.uri={storage}", f"run.name={name}",
           "cluster.workers=2", "cluster.cpus_per_worker=1", "failure.max_restarts=20",
           "failure.hang_timeout_s=10", *overrides]
    log = open(run_dir.parent / f"{name}.log", "w")
    return subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=log, stderr=subprocess.STDOUT)


def inject(kind: str, rec: dict, nodes: list, head, tmp: Path, rng: random.Random) -> str:
    worker = rng.choice(rec["workers"])
    if kind == "worker_kill":
        os.kill(worker["pid"], signal.SIGKILL)
        return f"pid {worker['pid']}"
    if kind == "hang":
        os.kill(worker["pid"], signal.SIGSTOP)
        return f"pid {worker['pid']}"
    node = node_of(worker["pid"], nodes)
    if node is None:
        os.kill(worker["pid"], signal.SIGKILL)
        return f"pid {worker['pid']} (node not found: killed the worker)"
    nodes.remove(node)
    if kind == "node_kill":
        os.killpg(node.pid, signal.SIGKILL)
    else:
        node.send_signal(signal.SIGTERM)  # preemption: Ray drains the node with a deadline
    nodes.append(add_node(head, tmp, num_cpus=1))  # replacement capacity
    return f"node pid {node.pid}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", choices=sorted(JOBS), default="ddp")
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    kinds = args.kinds.split(",")
    overrides, metric = JOBS[args.trainer]

    tmp = Path(tempfile.mkdtemp(prefix="chaos-"))
    head = start_head(tmp, num_cpus=0)  # the head trains nothing: workers live on killable nodes
    nodes = [add_node(head, tmp, num_cpus=1) for _ in range(3)]
    faults, started = [], time.time()
    try:
        run_dir = tmp / "chaos"
        proc = launch(run_dir, head.address, tmp / "ckpt", overrides, "chaos")
        rec = wait(run_dir, lambda r: r.get("workers") and r.get("steps", 0) > 0, proc)
        total = _total_steps(rec)
        targets = sorted(rng.sample(range(int(total * 0.05), int(total * 0.9)), args.faults))
        for target in targets:
            rec = wait(run_dir, lambda r, t=target: r.get("steps", 0) >= t and len(r.get("workers", [])) == 2, proc)
            if proc.poll() is not None:
                break
            kind = rng.choice(kinds)
            groups, lost_before = len(rec["world_sizes"]), rec["lost_steps"]
            at, step = time.time(), rec["steps"]
            target_desc = inject(kind, rec, nodes, head, tmp, rng)
            after = wait(run_dir, lambda r, g=groups: len(r.get("world_sizes", [])) > g and
                         r.get("steps", 0) > r["world_sizes"][-1]["step"], proc)
            faults.append({
                "kind": kind, "target": target_desc, "step": step,
                "recovery_s": round(time.time() - at, 1),
                "resumed_at_step": after["world_sizes"][-1]["step"] if len(after.get("world_sizes", [])) > groups else None,
                "lost_steps": after.get("lost_steps", 0) - lost_before,
            })
        proc.wait(timeout=1800)
        chaos = read(run_dir)
        clean_dir = tmp / "fault-free"
        clean = launch(clean_dir, head.address, tmp / "ckpt", overrides, "fault-free")
        clean.wait(timeout=1800)
        reference = read(clean_dir)
    finally:
        for node in nodes:
            stop_head(node)
        stop_cluster(head)

    value, ref = chaos.get("metrics", {}).get(metric), reference.get("metrics", {}).get(metric)
    print(json.dumps({
        "trainer": args.trainer, "seed": args.seed, "faults_injected": len(faults),
        "status": chaos.get("status"), "fault_free_status": reference.get("status"),
        "metric": metric, "final_metric": value, "fault_free_metric": ref,
        "relative_difference": round(abs(value - ref) / ref, 5) if value and ref else None,
        "restarts": chaos.get("restarts"), "preemptions": chaos.get("preemptions"),
        "lost_steps": chaos.get("lost_steps"), "steps": chaos.get("steps"),
        "wall_s": chaos.get("wall_s"), "fault_free_wall_s": reference.get("wall_s"),
        "faults": faults, "elapsed_s": round(time.time() - started, 1), "logs": str(tmp),
    }, indent=2))


def _total_steps(rec: dict) -> int:
    trainer = rec["config"]["trainer"]
    if "num_boost_round" in trainer:
        return int(trainer["num_boost_round"])
    return int(trainer["epochs"]) * (1437 // int(trainer["batch_size"]))  # digits: 1437 train rows


if __name__ == "__main__":
    main()
