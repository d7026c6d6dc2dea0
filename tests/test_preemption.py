"""Preemption on a real multi-node Ray cluster, for every trainer: a notice (SIGTERM to a
`ray start` node, or `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`) makes every worker
checkpoint at the next step boundary and hold until the deadline, so the restart loses no step."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.storage.location import StorageSpec
from scripts.local_cluster import RAY, node_env, node_of, stop_nodes
from tests.conftest import (
    REPO,
    add_node,
    read_record,
    start_head,
    start_run,
    stop_cluster,
    stop_head,
    user_project,
    wait_for,
)

# Each job must outlast the notice: Ray polls for drains every 5 s and the workers look for a
# notice about every failure.preemption_check_s (1 s), so the notice reaches them within ~6 s.
# Every job runs through the gate (tests/user_trainers.py): while the test's gate file exists,
# each job holds at step HOLD_AT until its workers agree on a notice, so the notice lands
# mid-run however fast or slow the machine, and only the few steps after HOLD_AT are left to
# run (at full speed: the test removes the gate once the restart is under way).
HOLD_AT, STEPS = 60, 80
GATED = ["trainer.fn=tests.user_trainers:gated", f"+trainer.hold_at={HOLD_AT}",
         "+trainer.hold_for_notice=true"]
BOOSTING = ["data=synthetic", "data.rows=50000", f"trainer.num_boost_round={STEPS}"]
JOBS = {
    # The PyTorch trainer with its state sharded (every rank writes its own shard at the
    # notice); DDP's replicated state is the user's own loop of the drain test below.
    "fsdp": ["trainer=fsdp", f"trainer.max_steps={STEPS}", "+trainer.inner=trainers.pytorch.train:main"],
    "mwms": ["trainer=mwms", f"trainer.max_steps={STEPS}", "+trainer.inner=trainers.mwms.train:main"],
    "xgboost": ["trainer=xgboost", "trainer.max_depth=4", *BOOSTING,
                "+trainer.inner=trainers.xgboost.train:main"],
    "lightgbm": ["trainer=lightgbm", "trainer.num_leaves=15", *BOOSTING,
                 "+trainer.inner=trainers.lightgbm.train:main"],
}
# The user's own loop (tests/user_project, run from a folder of its own) on the worker API;
# the gate only holds its ctx.step_done (the repository on the import path for it).
USER_FUNCTION = ["trainer=function", "+trainer.inner=mypkg.train:main", f"+trainer.steps={STEPS}"]
# The deadline of a drain: `ray drain-node --deadline-remaining-seconds`, and what these test
# nodes give themselves on SIGTERM (Ray's default: 30 s). The notice reached the workers 1-5 s
# after the drain in every run measured; holding until the deadline is what a test waits for.
DRAIN_DEADLINE_S = 12
NODE_ENV = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(DRAIN_DEADLINE_S)}


@pytest.fixture(scope="module")
def preemptible_cluster(tmp_path_factory):
    """A head that runs no training worker, and two 2-CPU nodes the workers live on: two jobs
    at a time, each packed on a node of its own. Each test preempts the nodes its workers run
    on and adds the replacements the next test uses."""
    tmp = tmp_path_factory.mktemp("ray-preemption")
    head = start_head(tmp, num_cpus=0)
    nodes = [add_node(head, tmp, num_cpus=2, env=NODE_ENV) for _ in range(2)]
    yield head, tmp, nodes
    stop_nodes(nodes)
    stop_cluster(head)


def start_job(head, run_dir, job: list[str], cwd=None):
    """The job, paced while <run_dir's folder>/gate exists."""
    gate = run_dir.parent / "gate"
    gate.touch()
    return start_run(run_dir, f"cluster.address={head.address}",
                     f"storage.uri={run_dir.parent / 'ckpt'}", "checkpoint.every_steps=500",
                     "checkpoint.keep=0", "cluster.cpus_per_worker=1", *GATED,
                     f"+trainer.gate={gate}", *job,
                     **({"cwd": cwd, "env": {"PYTHONPATH": str(REPO)}} if cwd else {}))


def restarted(*run_dirs) -> None:
    """Wait until the jobs resumed after the notice, then let them run at full speed."""
    for run_dir in run_dirs:
        wait_for(lambda r: len(r.get("world_sizes", [])) == 2, run_dir, timeout=300)
    (run_dirs[0].parent / "gate").unlink()


def running(run_dir) -> dict:
    return wait_for(lambda r: r.get("steps", 0) >= 1 and len(r.get("workers", [])) == 2, run_dir)


def finish(proc, run_dir) -> tuple[dict, str]:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    return read_record(run_dir), out


def assert_saved_at_the_notice(rec: dict, out: str) -> dict:
    assert rec["status"] == "succeeded"
    assert rec["preemptions"] == 1 and rec["restarts"] == 0, rec["failures"]
    notice = rec["preemption_notices"][0]
    assert 0 < notice["deadline_in_s"] <= DRAIN_DEADLINE_S and notice["nodes"], notice
    # The checkpoint was taken at the notice's step, and the restart began exactly there.
    assert notice["step"] in [c["step"] for c in rec["checkpoints"]]
    assert [w["step"] for w in rec["world_sizes"]] == [0, notice["step"]], rec["world_sizes"]
    assert rec["lost_steps"] == 0
    assert "preemption notice" in out and f"checkpointing at step {notice['step']}" in out
    return notice


@pytest.mark.slow
@pytest.mark.parametrize("pair", [("fsdp", "mwms"), ("xgboost", "lightgbm")])
def test_sigterm_to_a_node_saves_before_the_deadline_and_loses_no_step(preemptible_cluster,
                                                                       tmp_path, pair):
    """Two jobs at once, each on a node of its own: both nodes get SIGTERM (what a cloud does
    to spot VMs: Ray drains them) and two new nodes come up."""
    head, tmp, nodes = preemptible_cluster
    procs = {trainer: start_job(head, tmp_path / trainer, JOBS[trainer]) for trainer in pair}
    preempted = set()
    try:
        for trainer in pair:
            rec = running(tmp_path / trainer)
            node = node_of(rec["workers"][0], nodes)
            assert node is not None and node is node_of(rec["workers"][1], nodes)
            preempted.add(node)
        assert len(preempted) == 2, "the two jobs share a node"
        for node in preempted:
            nodes.remove(node)
            node.send_signal(signal.SIGTERM)
        nodes.extend(add_node(head, tmp, num_cpus=2, env=NODE_ENV) for _ in range(2))
        restarted(*(tmp_path / trainer for trainer in pair))
        finished = {trainer: finish(proc, tmp_path / trainer) for trainer, proc in procs.items()}
    finally:
        for node in preempted:
            stop_head(node)
    for trainer, (rec, out) in finished.items():
        notice = assert_saved_at_the_notice(rec, out)
        assert notice["step"] < rec["steps"]  # the notice came in the middle of the run
        if trainer == "fsdp":  # both ranks' shards are in the checkpoint taken at the notice
            store = CheckpointStore(StorageSpec(rec["checkpoint_uri"]))
            files = store.read_manifest(store.ref(notice["step"]))["files"]
            assert {e["rank"] for n, e in files.items() if n.endswith(".distcp")} == {0, 1}, files


# A user's unchanged torchrun script (trainer=script): it saves its snapshot when it gets SIGTERM.
# It holds after epoch EPOCHS - 4 while the gate exists, until SIGTERM comes.
SCRIPT = ["trainer=script", "trainer.checkpoint_files=[snapshot.pt]"]
EPOCHS = 16


def drain(head, node_id: str) -> None:
    done = subprocess.run(
        [RAY, "drain-node", f"--address={head.address}", f"--node-id={node_id}",
         "--reason=DRAIN_NODE_REASON_PREEMPTION", "--reason-message=spot instance reclaimed",
         f"--deadline-remaining-seconds={DRAIN_DEADLINE_S}"],
        env=node_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def actors_of_class(head, name: str) -> list:
    """Every actor of that class the cluster made, dead ones included (Ray's state API)."""
    listed = subprocess.run(
        [RAY, "list", "actors", f"--address={head.dashboard}", f"--filter=class_name={name}",
         "--format=json", "--limit=10000"], env=node_env(), capture_output=True, text=True,
        timeout=120)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    return [] if listed.stdout.startswith("No resource") else json.loads(listed.stdout)


@pytest.mark.slow
def test_ray_drain_node_with_reason_preemption_saves_a_users_own_loop_and_script_at_the_notice(
        preemptible_cluster, tmp_path):
    """Two jobs, each on a node of its own, both nodes drained: the notice reaches a user's own
    training function (ctx.should_preempt), which saves every rank's files at that step and
    returns, and a user's unchanged script (trainer=script), whose every rank gets SIGTERM and
    whose snapshot written then is committed; neither loses a step or an epoch."""
    head, tmp, nodes = preemptible_cluster
    project = user_project(tmp_path)
    proc = start_job(head, tmp_path / "run", USER_FUNCTION, cwd=project)
    gate = tmp_path / "gate"  # start_job made it: the script's epochs are paced while it exists
    script = start_run(tmp_path / "script", f"cluster.address={head.address}",
                       f"storage.uri={tmp_path / 'ckpt'}", "checkpoint.keep=0",
                       "cluster.cpus_per_worker=1", *SCRIPT,
                       f"trainer.command=python scripts/ddp_snapshot.py {EPOCHS} 1 --pace-while {gate} "
                       f"--hold-at {EPOCHS - 4}",
                       cwd=project)
    rec = running(tmp_path / "run")
    script_rec = wait_for(lambda r: len(r.get("checkpoints", [])) >= 2
                          and len(r.get("workers", [])) == 2, tmp_path / "script")
    drained = {node_of(rec["workers"][0], nodes),
               node_of(script_rec["workers"][0], nodes)}
    assert len(drained) == 2 and None not in drained, "the two jobs share a node"
    node_ids = [rec["workers"][0]["node"], script_rec["workers"][0]["node"]]
    for node_id in node_ids:
        drain(head, node_id)
    nodes.extend(add_node(head, tmp, num_cpus=2, env=NODE_ENV) for _ in range(2))
    try:
        restarted(tmp_path / "run", tmp_path / "script")
        rec, out = finish(proc, tmp_path / "run")
        script_rec, _ = finish(script, tmp_path / "script")
    finally:
        # `ray drain-node` does not take the node away; the cloud would, at the deadline.
        for node in drained:
            nodes.remove(node)
            stop_head(node)
    notice = assert_saved_at_the_notice(rec, out)
    assert notice["nodes"] == [node_ids[0]]
    # The notice came from the watcher in each run's controller (ray_internals/
    # preemption_watch.py): no run of this cluster started Ray Train's watcher actor; and the
    # ranks agreed on it (other nodes' workers) at the barrier each controller holds
    # (controller_barrier.py): none started Ray Train's synchronization actor either.
    assert actors_of_class(head, "TrainController") and not actors_of_class(head, "PreemptionWatcher")
    assert not actors_of_class(head, "SynchronizationActor")
    assert rec["trainer"] == "function" and rec["metrics"]["accuracy"] > 0.9
    assert all(w["node"] != node_ids[0] for w in rec["workers"])  # the restart avoided it

    # The script: SIGTERM reached both ranks at the notice, rank 0's snapshot written then was
    # committed, and the restart resumed at the very next epoch.
    assert script_rec["status"] == "succeeded"
    assert script_rec["preemptions"] == 1 and script_rec["restarts"] == 0, script_rec["failures"]
    logs = [(tmp_path / "script" / "logs" / f"rank_{r}.log").read_text() for r in (0, 1)]
    assert all(f"rank {r} got SIGTERM" in logs[r] for r in (0, 1)), logs
    stopped = int(logs[0].split("rank 0 stopping after epoch ")[1].split()[0])
    assert f"Resuming training from snapshot at Epoch {stopped + 1}\n" in logs[0]
    assert f"Epoch {EPOCHS - 1} | Training snapshot saved" in logs[0]
