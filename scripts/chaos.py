"""Chaos: one job on a multi-node Ray cluster, faults injected at seeded random steps.

    python scripts/chaos.py --trainer ddp --faults 10 --seed 0
    python scripts/chaos.py --trainer xgboost --faults 10 --seed 0
    python scripts/chaos.py --hosts 3 --faults 10          # on test hosts (root, Linux)

Fault kinds: worker_kill (SIGKILL a training worker), node_kill (SIGKILL a node's processes),
preemption (SIGTERM a node: Ray drains it with a deadline), hang (SIGSTOP a worker), and with
--hosts partition (a worker host's link goes down; it comes back once Ray has declared the
node dead, and joins again with a new `ray start`). A killed or preempted node is replaced by
a new one. By default the cluster is a head and three `ray start` nodes on 127.0.0.1; with
--hosts N it is N test hosts with their own network and disks (scripts/local_hosts.py): the
head, the driver and SeaweedFS (the checkpoints' S3) on host 1, 2 CPUs on each other host.
Prints JSON: per fault its kind, the step it hit, the recovery time (fault to the next
completed step) and the steps lost; then the run's final metric against a fault-free run of
the same job on the same cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
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
HOST_KINDS = (*KINDS, "partition")
# Ray's node health check on the test hosts' head: a cut-off host is declared dead after
# ~15-20 s instead of ~65 s (Ray's defaults), so that a partition's host rejoins sooner.
HOSTS_HEALTH = {"health_check_period_ms": 1000, "health_check_timeout_ms": 2000,
                "health_check_failure_threshold": 6}
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


def launch(cluster, run_dir: Path, overrides: list[str], name: str):
    cmd = [sys.executable, "-m", "orchestrator", f"hydra.run.dir={run_dir}",
           f"cluster.address={cluster.address}", *cluster.storage, f"run.name={name}",
           "cluster.workers=2", "cluster.cpus_per_worker=1", "failure.max_restarts=20",
           "failure.hang_timeout_s=10", *overrides]
    return cluster.popen(cmd, open(run_dir.parent / f"{name}.log", "w"))


class LoopbackCluster:
    """A head and three `ray start` nodes on 127.0.0.1, sharing this machine's disk."""

    kinds = KINDS

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.head = start_head(tmp, num_cpus=0)  # the head trains nothing
        self.nodes = [add_node(self.head, tmp, num_cpus=1) for _ in range(3)]
        self.address, self.storage = self.head.address, [f"storage.uri={tmp / 'ckpt'}"]

    def popen(self, cmd: list[str], log) -> subprocess.Popen:
        return subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=log, stderr=subprocess.STDOUT)

    def inject(self, kind: str, rec: dict, rng: random.Random) -> str:
        worker = rng.choice(rec["workers"])
        if kind in ("worker_kill", "hang"):
            os.kill(worker["pid"], signal.SIGKILL if kind == "worker_kill" else signal.SIGSTOP)
            return f"pid {worker['pid']}"
        node = node_of(worker, self.nodes)
        if node is None:
            os.kill(worker["pid"], signal.SIGKILL)
            return f"pid {worker['pid']} (node not found: killed the worker)"
        self.nodes.remove(node)
        if kind == "node_kill":
            os.killpg(node.pid, signal.SIGKILL)
        else:
            node.send_signal(signal.SIGTERM)  # preemption: Ray drains the node with a deadline
        self.nodes.append(add_node(self.head, self.tmp, num_cpus=1))  # replacement capacity
        return f"node pid {node.pid}"

    def settle(self) -> None:
        pass

    def close(self) -> None:
        for node in self.nodes:
            stop_head(node)
        stop_cluster(self.head)  # and /tmp/ray/ray_current_cluster as it was


class HostsCluster:
    """Test hosts with their own network and disks; a lost host comes back in the background
    (a killed or preempted one as a new node at once, a partitioned one once Ray has declared
    it dead), while the job goes on on the others."""

    kinds = HOST_KINDS

    def __init__(self, count: int):
        from scripts.local_hosts import LocalHosts

        self.hosts = LocalHosts(count).__enter__()
        self.restorers: list[threading.Thread] = []
        self.restored: list[str] = []
        self.s3 = None
        # Checkpoints in S3 on host 1, as on a real cluster: a cut-off host cannot write
        # there (a directory shared by bind mounts here would still be reachable from it).
        from scripts.s3_server import SeaweedS3

        try:
            self.hosts.start_ray(head_cpus=0, node_cpus=2, health=HOSTS_HEALTH)
            self.s3 = SeaweedS3(self.hosts.head.dir / "seaweed", host=self.hosts.head.ip,
                                command_prefix=tuple(self.hosts.command(1, []))).start()
            self.s3.filesystem().create_dir("chaos")
        except BaseException:
            self.close()
            raise
        self.address = self.hosts.address
        self.storage = ["storage=s3", "storage.uri=s3://chaos/runs",
                        f"storage.endpoint={self.s3.endpoint}"]

    def popen(self, cmd: list[str], log) -> subprocess.Popen:
        env = {"AWS_ACCESS_KEY_ID": self.s3.access_key, "AWS_SECRET_ACCESS_KEY": self.s3.secret_key}
        return self.hosts.popen(1, cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def inject(self, kind: str, rec: dict, rng: random.Random) -> str:
        worker = rng.choice(rec["workers"])
        host = self.hosts.host_of(worker["pid"])
        if kind in ("worker_kill", "hang"):
            os.kill(worker["pid"], signal.SIGKILL if kind == "worker_kill" else signal.SIGSTOP)
            return f"pid {worker['pid']} on host {host}"
        if host is None:
            os.kill(worker["pid"], signal.SIGKILL)
            return f"pid {worker['pid']} (host not found: killed the worker)"
        if kind == "node_kill":
            self.hosts.kill_host(host)
            self._restore(host, lambda: self.hosts.restart_ray(host))
        elif kind == "preemption":
            ray_start = self.hosts.hosts[host - 1].ray
            ray_start.send_signal(signal.SIGTERM)  # Ray drains the node with a deadline
            self._restore(host, lambda: (ray_start.wait(timeout=180), self.hosts.restart_ray(host)))
        else:
            self.hosts.partition(host)
            self._restore(host, lambda: self._heal_when_dead(host))
        return f"host {host}"

    def _heal_when_dead(self, host: int) -> str:
        deadline = time.time() + 180
        while self.hosts.node_state(self.hosts.hosts[host - 1].ip) != "DEAD" and time.time() < deadline:
            time.sleep(1)
        return self.hosts.heal(host)

    def _restore(self, host: int, action) -> None:
        def run():
            started = time.time()
            try:
                how = action()
                self.restored.append(f"host {host}: {how if isinstance(how, str) else 'restarted'} "
                                     f"after {time.time() - started:.0f} s")
            except Exception as exc:  # reported in the JSON; the run goes on without it
                self.restored.append(f"host {host}: not restored ({exc})")

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.restorers.append(thread)

    def settle(self) -> None:
        """Every host back before the fault-free run."""
        for thread in self.restorers:
            thread.join(timeout=300)

    def close(self) -> None:
        self.settle()
        if self.s3 is not None:
            self.s3.stop(kill=True)
        self.hosts.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", choices=sorted(JOBS), default="ddp")
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=None,
                        help=f"comma-separated (default: {','.join(KINDS)}; with --hosts also partition)")
    parser.add_argument("--hosts", type=int, default=None,
                        help="run on this many test hosts (scripts/local_hosts.py; root)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    overrides, metric = JOBS[args.trainer]

    if args.hosts:
        cluster = HostsCluster(args.hosts)
        tmp = cluster.hosts.root / "chaos"  # the driver runs on host 1, whose /tmp is its own
        tmp.mkdir()
    else:
        tmp = Path(tempfile.mkdtemp(prefix="chaos-"))
        cluster = LoopbackCluster(tmp)
    kinds = args.kinds.split(",") if args.kinds else list(cluster.kinds)
    faults, started = [], time.time()
    try:
        run_dir = tmp / "chaos"
        proc = launch(cluster, run_dir, overrides, "chaos")
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
            target_desc = cluster.inject(kind, rec, rng)
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
        cluster.settle()
        clean_dir = tmp / "fault-free"
        clean = launch(cluster, clean_dir, overrides, "fault-free")
        clean.wait(timeout=1800)
        reference = read(clean_dir)
    finally:
        if args.hosts:  # the hosts' files go with them: keep the logs and records
            kept = Path(tempfile.mkdtemp(prefix="chaos-hosts-"))
            for name in ("chaos", "fault-free"):
                for src in (tmp / name / "run.json", tmp / f"{name}.log"):
                    if src.exists():
                        (kept / src.relative_to(tmp)).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy(src, kept / src.relative_to(tmp))
            tmp = kept
        cluster.close()

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
        **({"hosts": args.hosts, "ray_health_check": HOSTS_HEALTH,
            "hosts_restored": cluster.restored} if args.hosts else {}),
    }, indent=2))


def _total_steps(rec: dict) -> int:
    trainer = rec["config"]["trainer"]
    if "num_boost_round" in trainer:
        return int(trainer["num_boost_round"])
    return int(trainer["epochs"]) * (1437 // int(trainer["batch_size"]))  # digits: 1437 train rows


if __name__ == "__main__":
    main()
