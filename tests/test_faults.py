"""Faults on real Ray: a killed worker, a hung worker, a bug that repeats; and the decisions."""

from __future__ import annotations

import os
import signal
import time
from importlib import metadata
from pathlib import Path

import pytest

from orchestrator.driver.failure_policy import WorkerError, classify
from orchestrator.worker.warm import WARM_IMPORTS
from tests.conftest import read_record, run_cli, start_head, start_run, stop_cluster, wait_for
from tests.helpers import of_raylet, raylet_of, train_page_names, train_page_run


def error(step=35, kind="ValueError", message="bad batch", rank=0) -> WorkerError:
    return WorkerError(rank, step, kind, message, "Traceback ...")


@pytest.mark.parametrize(
    "history, new, permanent",
    [
        ([], error(), False),
        ([error()], error(), True),
        ([error(step=20)], error(step=35), False),  # another step: bad luck, retry
        ([error(kind="RuntimeError")], error(), False),
        ([error(message="other")], error(), False),
        ([error(rank=1)], error(rank=0), True),  # the same bug, wherever it shows up
        ([], WorkerError(0, 35, "NonFiniteLoss", "nan", "", retry=False), True),  # says so
        # XGBoost's errors start with its clock: the same error a second later repeats
        ([error(kind="XGBoostError", message="[00:07:16] src/x.cc:38: label must be in (0, 1)")],
         error(kind="XGBoostError", message="[00:07:17] src/x.cc:38: label must be in (0, 1)"), True),
        # what differs between two processes raising the same bug: an address, the worker's
        # own folder, the DataLoader process
        ([error(kind="TypeError", message="bad <Foo object at 0x7f3a2c1d0>")],
         error(kind="TypeError", message="bad <Foo object at 0x7f99e0b10>"), True),
        ([error(kind="FileNotFoundError", message="/tmp/orchestrator-rank0-ab12cd_e/x.npy")],
         error(kind="FileNotFoundError", message="/tmp/orchestrator-rank0-zz9yy8x_/x.npy"), True),
        ([error(kind="IndexError", message="bad row 37 (in DataLoader worker process 1)")],
         error(kind="IndexError", message="bad row 37 (in DataLoader worker process 2)"), True),
        # a peer's port is not one: survivors of a kill are not a repeated bug
        ([error(kind="RuntimeError", message="Connection reset by peer [127.0.0.1]:21414")],
         error(kind="RuntimeError", message="Connection reset by peer [127.0.0.1]:30112"), False),
    ],
)
def test_a_failure_is_permanent_when_it_repeats_at_the_same_step(history, new, permanent):
    verdict = classify(history, new)
    assert verdict.permanent is permanent
    assert verdict.reason.startswith("PERMANENT" if permanent else "RETRY")


def test_a_bug_that_repeats_stops_the_run_without_burning_every_restart(ray_head, tmp_path):
    """And the dashboard's Train page shows the run, failed, with its two attempts."""
    name = f"bug-{tmp_path.name}"
    result = run_cli(tmp_path / "run", f"cluster.address={ray_head.address}",
                     f"storage.uri={tmp_path / 'ckpt'}", "failure.max_restarts=5",
                     "trainer.fn=tests.user_trainers:fails_at_step_35", f"run.name={name}",
                     "checkpoint.every_steps=10", "trainer.max_steps=100")
    assert result.returncode == 1, result.output[-3000:]
    rec = result.record
    assert rec["status"] == "failed" and rec["restarts"] == 1  # not 5
    assert "ValueError: bad batch at step 35" in rec["error"] and "Traceback" in rec["permanent_error"]
    assert [f["step"] for f in rec["failures"] if f["error"] == "ValueError"] == [35, 35]
    # The permanent verdict ended fit() (ray_internals/failure_decisions.py): no worker group
    # started after the one that failed for the second time (the record names its workers).
    last = [f for f in rec["failures"] if f["error"] == "ValueError"][-1]
    assert last["pid"] in {w["pid"] for w in rec["workers"]}, (last, rec["workers"])
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: {rec['error']}"], result.stderr[-3000:]  # one line, as recorded
    assert errors[0].startswith("error: training failed permanently") and "\n" not in rec["error"]
    assert "worker rank 0 at step 35: ValueError" in errors[0]
    page, _ = train_page_run(ray_head.dashboard, name)
    assert page["status"] == "ERRORED" and "ValueError: bad batch at step 35" in page["status_detail"]
    assert [len(a["workers"]) for a in page["attempts"]] == [2, 2], page["attempts"]


def test_workers_the_cluster_cannot_place_stop_the_run_with_one_line(ray_head, tmp_path):
    """4 workers of one CPU on the 2-CPU head: Ray Train alone waits forever, silently. (Run
    with cluster.dashboard_train_page=false: the Train page does not list it.)"""
    name = f"noroom-{tmp_path.name}"
    result = run_cli(tmp_path / "run", f"cluster.address={ray_head.address}",
                     f"storage.uri={tmp_path / 'ckpt'}", "cluster.workers=4", f"run.name={name}",
                     "cluster.dashboard_train_page=false",
                     "cluster.cpus_per_worker=1", "cluster.placement_timeout_s=5", timeout=300)
    assert result.returncode == 1, result.output[-3000:]
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [ln for ln in errors if "no room for {'CPU': 1.0} * 4 workers after" in ln]
    assert len(errors) == 1 and "(cluster.placement_timeout_s=5); the cluster has 1 node: " in \
        errors[0] and "CPU 2/2 free" in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.output
    rec = result.record
    assert rec["status"] == "failed" and "no room for" in rec["error"] and rec["steps"] == 0
    assert name not in train_page_names(ray_head.dashboard)


HANG_TIMEOUT_S = 5  # the least failure.hang_timeout_s allows: what is tested does not need more


@pytest.mark.slow
def test_a_hung_worker_is_detected_and_replaced(ray_head, tmp_path):
    # Paced (>= 20 ms a step) while the gate exists: the hang lands mid-run; once the new
    # group runs, the rest goes at full speed.
    gate = tmp_path / "gate"
    gate.touch()
    raylet = raylet_of(ray_head.address)
    assert raylet is not None, ray_head.address

    def idle_worker_processes():  # this head's only (another Ray's on the machine are not ours)
        return idle_on(raylet)
    idle_before = idle_worker_processes()
    name = f"hung-{tmp_path.name}"
    proc = start_run(tmp_path / "a", f"cluster.address={ray_head.address}",
                     f"storage.uri={tmp_path / 'ckpt'}", "trainer.epochs=40", f"run.name={name}",
                     "+trainer.api_token=sk-page-secret-1234",  # a secret of the user's config
                     "trainer.fn=tests.user_trainers:gated_ddp", f"+trainer.gate={gate}",
                     "+trainer.pace_s=0.02", "checkpoint.every_steps=100",
                     f"failure.hang_timeout_s={HANG_TIMEOUT_S}", "failure.spare_after_s=0")
    rec = wait_for(lambda r: r.get("checkpoints") and len(r.get("workers", [])) == 2, tmp_path / "a")
    victim, healthy = rec["workers"][1]["pid"], rec["workers"][0]["pid"]
    # Each worker had its node keep a process ready for its replacement (failure.spare_after_s;
    # orchestrator/worker/spare.py): idle, with the workers' environment, torch imported.
    spares = wait_until(lambda: idle_worker_processes() - {victim, healthy},
                        lambda found: len(found) >= 2)
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.time()
    deadline = stopped_at + 120
    while alive_pid(healthy) and time.time() < deadline:
        time.sleep(0.2)
    torn_down_in = time.time() - stopped_at
    wait_for(lambda r: len(r.get("world_sizes", [])) == 2, tmp_path / "a")
    gate.unlink()
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    rec = read_record(tmp_path / "a")
    assert rec["status"] == "succeeded" and rec["restarts"] == 1
    assert victim not in [w["pid"] for w in rec["workers"]]
    # The new group ran in the processes kept ready, not new ones; none outlived the job.
    assert {w["pid"] for w in rec["workers"]} <= spares, (rec["workers"], spares)
    assert not [w for w in rec["warnings"] if "no process kept ready" in w], rec["warnings"]
    wait_until(lambda: idle_worker_processes() - idle_before, lambda left: not left, timeout=60)
    # The old group is gone ~12 s after the hang: 5 s of silence (not torch's 30-minute
    # collective timeout), at most 2 s asking the workers to leave the process group (Ray's
    # default waits 30 s for the hung one), Ray's fixed 5 s of patience before killing them.
    # What follows (a new worker group, ~20 s here) is Ray start-up.
    assert torn_down_in < HANG_TIMEOUT_S + 20, torn_down_in
    # The dashboard's Train page: the run by its name, its two attempts (the second after the
    # hang), finished; no secret of its config, nor of its command line, in the whole page.
    page, text = train_page_run(ray_head.dashboard, name)
    assert page["status"] == "FINISHED" and len(page["attempts"]) == 2, page["attempts"]
    # The versions rank 0 told (as plain strings: ray_internals/train_page.py).
    assert page["framework_versions"]["torch"] == metadata.version("torch"), page
    assert "sk-page-secret-1234" not in text and "api_token" in text


@pytest.mark.slow
def test_another_clusters_ray_start_on_the_machine_does_not_restart_the_job(ray_head, tmp_path):
    """`ray start` records its cluster in /tmp/ray/ray_current_cluster; Ray Train's placement
    group cleaner used to look our controller up in that cluster, not find it, and remove the
    workers' placement group (a restart with no error). The job pins RAY_ADDRESS to its own."""
    proc = start_run(tmp_path / "run", f"cluster.address={ray_head.address}",
                     f"storage.uri={tmp_path / 'ckpt'}", "trainer.epochs=3000",
                     "checkpoint.every_steps=1000")
    rec = wait_for(lambda r: r.get("steps", 0) > 0 and len(r.get("workers", [])) == 2,
                   tmp_path / "run")
    other = start_head(tmp_path, num_cpus=0)  # now the cluster this machine last started
    try:
        time.sleep(5)  # the cleaner looks every second; a removed group's workers die at once
        alive = [alive_pid(w["pid"]) for w in rec["workers"]]
        rec = read_record(tmp_path / "run")
    finally:
        stop_cluster(other)
        # kill, timeout, a scheduler's end: as a Ctrl-C (the driver died at once, and run.json
        # said "running" for good)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=300)
    assert all(alive), "the workers were killed when another cluster started"
    assert rec["status"] == "running", rec.get("error")  # still going when we looked
    assert len(rec["world_sizes"]) == 1 and rec["restarts"] == 0, rec["world_sizes"]
    final = read_record(tmp_path / "run")
    assert proc.returncode == 130 and final["status"] == "interrupted", final.get("error")
    assert final["error"] == "interrupted (SIGTERM)"


def idle_on(raylet: int) -> set[int]:
    """Ray worker processes of this raylet with the training workers' environment that no
    actor has taken yet (a worker's own process, just started, or one kept ready for a restart).
    A process forked from the run's fork server (only training workers are) shows the server's
    environment in /proc, not its own."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if title.startswith(b"ray::IDLE") and of_raylet(env, raylet) and \
                (WARM_IMPORTS.encode() + b"=" in env or forked(int(pid))):
            found.add(int(pid))
    return found


def forked(pid: int) -> bool:
    """The process is a child of a fork server (orchestrator/ray_internals/fork_server/)."""
    try:
        parent = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1]
        return b"fork_server/server.py" in Path(f"/proc/{parent}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False


def wait_until(probe, done, timeout: float = 120):
    """probe()'s first value that is done(); fails after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while True:
        value = probe()
        if done(value):
            return value
        assert time.time() < deadline, f"timed out at {value}"
        time.sleep(0.2)


def alive_pid(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
