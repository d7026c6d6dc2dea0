"""Three test hosts, each with its own network, /tmp and local disk (scripts/local_hosts.py):
storage that is not shared is refused before any worker starts; a shared mount survives the
loss of rank 0's host; a worker host cut off mid-run is dropped and rejoins, and the run ends
as a fixed-size run does. Needs root (network namespaces); skipped elsewhere.

Host 1 runs the Ray head (no CPUs for training), the driver and SeaweedFS; hosts 2 and 3 each
offer 2 CPUs. The driver always runs on host 1, inside its namespaces."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from scripts.local_hosts import LocalHosts, leftovers
from tests.conftest import REPO, cli_command

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not all(shutil.which(c) for c in ("ip", "unshare", "nsenter")),
                       reason="test hosts need root, ip, unshare and nsenter (Linux)"),
]

# Ray's node health check on the head, shortened (Ray's defaults declare a silent node dead
# after ~65 s): what the tests check does not depend on its length, only the wait does.
HEALTH = {"health_check_period_ms": 1000, "health_check_timeout_ms": 2000,
          "health_check_failure_threshold": 6}
BUCKET = "hosts"
# The DDP default job (digits, 880 steps of >= 8 ms), held at step 700 while the test's gate
# file exists: however fast or slow the machine, it never ends before the faults are done.
JOB = ["trainer.fn=tests.user_trainers:gated_ddp", "trainer.epochs=40", "+trainer.hold_at=700",
       "checkpoint.every_steps=100", "cluster.cpus_per_worker=1", "failure.hang_timeout_s=10",
       "log.progress_every_s=5"]


@dataclass
class Cluster:
    hosts: LocalHosts
    s3: object  # scripts.s3_server.SeaweedS3, on host 1
    results: dict  # metrics of the runs so far, by test
    suspect: bool = False  # a test failed on it: the next one gets the hosts' Ray anew

    def run_dir(self, name: str) -> Path:
        return self.hosts.root / "runs" / name

    def command(self, name: str, *overrides: str) -> list[str]:
        return cli_command(self.run_dir(name), f"cluster.address={self.hosts.address}", *overrides)

    def env(self) -> dict:
        return {"AWS_ACCESS_KEY_ID": self.s3.access_key, "AWS_SECRET_ACCESS_KEY": self.s3.secret_key}

    def start(self, name: str, *overrides: str) -> subprocess.Popen:
        """The command, started on host 1; its stdout and stderr go to <name>.out/.err."""
        out, err = (open(self.hosts.root / f"{name}.{x}", "w") for x in ("out", "err"))
        return self.hosts.popen(1, self.command(name, *overrides), cwd=REPO, env=self.env(),
                                stdout=out, stderr=err, text=True)

    def output(self, name: str, streams: tuple[str, ...] = ("out", "err")) -> str:
        return "".join((self.hosts.root / f"{name}.{x}").read_text() for x in streams)

    def record(self, name: str) -> dict:
        try:
            return json.loads((self.run_dir(name) / "run.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def wait_for(self, name: str, predicate, proc: subprocess.Popen, timeout: float = 300) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            rec = self.record(name)
            if rec and predicate(rec):
                return rec
            if proc.poll() is not None:
                raise AssertionError(f"the run ended ({proc.returncode}): {self.output(name)[-3000:]}")
            time.sleep(0.3)
        raise AssertionError(f"timed out; record: {self.record(name)}")

    def gate(self, name: str) -> tuple[str, Path]:
        """A file on the shared mount: +trainer.gate=<the first> (the path on the hosts), and
        the second to remove (the same file seen from here); the job holds at JOB's hold_at
        step while it exists."""
        inside = self.hosts.shared / f"gate-{name}"
        here = self.hosts.host_path(1, inside)
        here.touch()
        return f"+trainer.gate={inside}", here


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from scripts.s3_server import SeaweedS3

    started = time.time()
    hosts = LocalHosts(3)
    s3 = None
    try:
        hosts.up()
        hosts.start_ray(head_cpus=0, node_cpus=2, health=HEALTH)
        # SeaweedFS on host 1, on its address (every host reaches it) and its loopback.
        s3 = SeaweedS3(hosts.head.dir / "seaweed", host=hosts.head.ip, bind="0.0.0.0",
                       command_prefix=tuple(hosts.command(1, [])))
        s3.start()
        s3.filesystem().create_dir(BUCKET)
        hosts.timings["cluster_s"] = round(time.time() - started, 1)
        print(f"\ntest hosts up: {hosts.timings}", file=sys.stderr)
        yield Cluster(hosts, s3, {})
    finally:
        keep_logs(hosts, tmp_path_factory.mktemp("hosts-logs"))
        if s3 is not None:
            s3.stop(kill=True)
        tag = hosts.tag
        hosts.down()
        # Pass or fail: no namespace, link, process or file of these test hosts is left (another
        # instance, a crashed run's or a second checkout's, has a tag of its own).
        assert leftovers(tag) == {"netns": [], "links": [], "dirs": []}, leftovers(tag)
        assert not hosts.root.exists()


@pytest.fixture(autouse=True)
def fresh_ray_after_a_failed_test(cluster, request):
    """One failed test must not fail the next: after a failure every host's link comes back
    up and the hosts' Ray starts anew (~10 s, paid only then)."""
    if cluster.suspect:
        cluster.hosts.restart_all()
        cluster.suspect = False
    failed_before = request.session.testsfailed
    yield
    cluster.suspect = request.session.testsfailed > failed_before


def keep_logs(hosts: LocalHosts, keep: Path) -> None:
    """The commands' output, run records and Ray Train's controller logs outlive the hosts."""
    if not hosts.hosts:
        return
    patterns = ["*.out", "*.err", "runs/*/run.json", "h1/tmp/ray/session_*/logs/train/*"]
    for pattern in patterns:
        for path in hosts.root.glob(pattern):
            target = keep / path.relative_to(hosts.root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target)
    print(f"test hosts' logs: {keep}", file=sys.stderr)


def one_error_line(cluster: Cluster, name: str, returncode: int) -> str:
    """Exit 2, and stderr is exactly one `error: ...` line."""
    lines = [ln for ln in cluster.output(name, ("err",)).splitlines() if ln.strip()]
    assert returncode == 2 and len(lines) == 1, cluster.output(name)[-3000:]
    assert lines[0].startswith("error: "), lines
    return lines[0]


def files_under(*folders: Path) -> list[Path]:
    return [p for folder in folders if folder.exists() for p in folder.rglob("*")]


LATE_JOINER = """
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from orchestrator.storage.location import StorageSpec
from orchestrator.storage.probe import check_worker_node, leave_marker
ray.init(address="{address}", logging_level="ERROR", log_to_driver=False)
marker = leave_marker(StorageSpec("{run}"))
node = next(n["NodeID"] for n in ray.nodes() if n["NodeManagerAddress"] == "{ip}")
check = ray.remote(num_cpus=0)(check_worker_node).options(
    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
try:
    ray.get(check.remote(marker))
except Exception as exc:
    print("REFUSED:", getattr(exc, "cause", exc))
"""


def test_storage_not_shared_by_every_host_is_refused_before_any_worker_starts(cluster):
    """Three commands at once (each is mostly Python and Ray start-up): a directory that is
    each host's own disk; S3 at an endpoint only the driver's host reaches; and a worker on a
    node that joined after the driver's check."""
    hosts = cluster.hosts
    local = hosts.local_disk / "ckpt"  # the same path on every host, three disks behind it
    loopback = f"http://127.0.0.1:{cluster.s3.s3_port}"  # host 1's own loopback
    late = hosts.local_disk / "late" / "run"
    procs = {
        "local": cluster.start("local", f"storage.uri={local}", *JOB),
        "loopback": cluster.start("loopback", "storage=s3", "storage.uri=s3://fresh-bucket/runs",
                                  f"storage.endpoint={loopback}", *JOB),
        "late": hosts.popen(1, [sys.executable, "-c", LATE_JOINER.format(
            address=hosts.address, run=late, ip=hosts.hosts[2].ip)], cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
    }
    late_out = procs["late"].communicate(timeout=240)[0]
    for name in ("local", "loopback"):
        procs[name].wait(timeout=240)

    line = one_error_line(cluster, "local", procs["local"].returncode)
    assert f"storage.uri='{local}' is not shared by the cluster's nodes" in line
    for h in hosts.hosts[1:]:
        assert f"{h.ip}: no such file there" in line  # the two hosts that train
    assert "storage=s3" in line and "same path on every node" in line
    disks = [h.dir / "local" for h in hosts.hosts]  # each host's own disk, seen from here
    written = [p for p in files_under(*disks, hosts.host_path(1, hosts.shared))
               if "late" not in p.parts]
    assert written == []  # nothing written (the probe is gone too)
    assert not (cluster.run_dir("local") / "run.json").exists()  # no worker, no recorder

    line = one_error_line(cluster, "loopback", procs["loopback"].returncode)
    assert f"storage.endpoint='{loopback}' is not reachable from 2 of 3 nodes" in line, line
    buckets = cluster.s3.filesystem().get_file_info(pafs.FileSelector(""))
    assert "fresh-bucket" not in [b.base_name for b in buckets]  # made for the run, removed

    # The worker-side check, as a worker on host 3 runs it: host 1's disk is not there.
    assert f"REFUSED: node {hosts.hosts[2].ip} does not see the run's storage {late}" in late_out, \
        late_out[-3000:]
    shutil.rmtree(hosts.host_path(1, late.parent))


def test_a_partitioned_worker_host_is_dropped_then_rejoins_and_the_job_grows_back(cluster):
    """DDP, 4 workers (2 per host), elastic down to 2, checkpoints in S3 on host 1; the host
    of rank 0 loses its link mid-run, and gets it back once Ray has declared it dead."""
    hosts = cluster.hosts
    gate_arg, gate = cluster.gate("partition")
    proc = cluster.start("partition", "storage=s3", f"storage.uri=s3://{BUCKET}/runs",
                         f"storage.endpoint={cluster.s3.endpoint}", "cluster.workers=4",
                         "cluster.min_workers=2", "cluster.resize_check_s=2", "run.name=partition",
                         *JOB, gate_arg)
    try:
        rec = cluster.wait_for("partition", lambda r: len(r.get("workers", [])) == 4 and
                               any(c["step"] >= 200 for c in r.get("checkpoints", [])), proc)
        cut = hosts.host_of(next(w for w in rec["workers"] if w["rank"] == 0)["pid"])
        hosts.partition(cut)
        cut_at, failures = time.time(), len(rec.get("failures", []))
        # The ranks left wait on the cut-off ones in a collective: they fail after
        # failure.hang_timeout_s (10 s), as the cut-off ones' health checks do.
        cluster.wait_for("partition", lambda r: len(r.get("failures", [])) > failures, proc)
        detected_s = time.time() - cut_at
        rec = cluster.wait_for("partition", lambda r: r["world_sizes"][-1]["size"] == 2 and
                               r.get("steps", 0) > r["world_sizes"][-1]["step"], proc)
        shrunk_s = time.time() - cut_at
        deadline = time.time() + 120  # until Ray declares the cut-off node dead (HEALTH)
        while hosts.node_state(hosts.hosts[cut - 1].ip) != "DEAD" and time.time() < deadline:
            time.sleep(1)
        dead_s = time.time() - cut_at
        how = hosts.heal(cut)
        rec = cluster.wait_for("partition", lambda r: r["world_sizes"][-1]["size"] == 4 and
                               r.get("steps", 0) > r["world_sizes"][-1]["step"], proc)
        grown_s = time.time() - cut_at
        gate.unlink()
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        gate.unlink(missing_ok=True)
    print(f"\npartition: failed after {detected_s:.0f} s, training again at 2 after "
          f"{shrunk_s:.0f} s, node declared dead after {dead_s:.0f} s, link back and {how}, "
          f"at 4 again after {grown_s:.0f} s", file=sys.stderr)
    rec = cluster.record("partition")
    assert proc.returncode == 0, cluster.output("partition")[-4000:]
    sizes = [w["size"] for w in rec["world_sizes"]]
    assert sizes[0] == 4 and 2 in sizes and sizes[-1] == 4 and min(sizes) >= 2, sizes
    shrunk = next(w for w in rec["world_sizes"] if w["size"] == 2)
    assert shrunk["step"] >= 200 and shrunk["step"] in [c["step"] for c in rec["checkpoints"]]
    assert all(c["uri"].startswith(f"s3://{BUCKET}/runs/partition/step_") for c in rec["checkpoints"])
    assert rec["steps"] == 880 and rec["status"] == "succeeded"
    assert detected_s < 10 + 15, detected_s  # the hang timeout, and some slack for a busy machine
    cluster.results["partition"] = rec["metrics"]


def test_a_shared_mount_is_accepted_and_the_run_resumes_from_it_after_its_rank0_host_is_lost(
        cluster):
    """Also the fixed-size reference (2 workers throughout, resumed where it stopped: the same
    as never stopped) for the partitioned elastic run above."""
    hosts = cluster.hosts
    gate_arg, gate = cluster.gate("shared")
    storage = hosts.shared / "ckpt"
    proc = cluster.start("shared", f"storage.uri={storage}", "cluster.workers=2", "run.name=shared",
                         *JOB, gate_arg)
    try:
        rec = cluster.wait_for("shared", lambda r: len(r.get("workers", [])) == 2 and
                               any(c["step"] >= 200 for c in r.get("checkpoints", [])), proc)
        lost = hosts.host_of(next(w for w in rec["workers"] if w["rank"] == 0)["pid"])
        assert lost in (2, 3), rec["workers"]
        hosts.kill_host(lost)  # the machine is gone, and its local disk with it
        rec = cluster.wait_for("shared", lambda r: len(r.get("world_sizes", [])) == 2 and
                               r.get("steps", 0) > r["world_sizes"][1]["step"] and
                               len(r.get("workers", [])) == 2, proc)
        assert {hosts.host_of(w["pid"]) for w in rec["workers"]} == {5 - lost}  # the other one
        gate.unlink()
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        gate.unlink(missing_ok=True)
    rec = cluster.record("shared")
    assert proc.returncode == 0, cluster.output("shared")[-4000:]
    resumed = rec["world_sizes"][1]["step"]
    assert [w["size"] for w in rec["world_sizes"]] == [2, 2]
    assert resumed >= 200 and resumed in [c["step"] for c in rec["checkpoints"]]  # not from 0
    assert rec["steps"] == 880 and 0 <= rec["lost_steps"] <= 100
    assert f"resumed from {storage}/shared/step_{resumed:09d}" in cluster.output("shared")

    # The global batch and the data order do not depend on the world size: the partitioned
    # elastic run (4, 2, then 4 workers) ends where this fixed-size run does, within 1%.
    if "partition" not in cluster.results:
        pytest.skip("the partition test did not run (or failed) in this session")
    a, b = cluster.results["partition"]["test_accuracy"], rec["metrics"]["test_accuracy"]
    assert abs(a - b) <= 0.01 * b, (a, b)


def test_the_hosts_files_live_under_a_base_only_its_owner_may_write(tmp_path, monkeypatch):
    """/var/tmp is everyone's: a base folder another user made, linked elsewhere or left open
    to writes is refused before root writes anything through it."""
    import scripts.local_hosts as local_hosts

    base = tmp_path / "base"
    monkeypatch.setattr(local_hosts, "ROOT_BASE", base)
    assert local_hosts.private_base() == base and (base.stat().st_mode & 0o777) == 0o700
    base.chmod(0o777)
    with pytest.raises(RuntimeError, match="only it may write"):
        local_hosts.private_base()
    base.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    base.symlink_to(elsewhere)
    with pytest.raises(RuntimeError, match="only it may write"):
        local_hosts.private_base()
