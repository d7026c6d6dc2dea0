"""Preemption on a real multi-node Ray cluster, for every trainer: a notice (SIGTERM to a
`ray start` node, or `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`) makes every worker
checkpoint at the next step boundary and hold until the deadline, so the restart loses no step."""

from __future__ import annotations

import signal
import subprocess

import pytest

from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.storage import StorageSpec
from scripts.local_cluster import RAY, node_env, node_of, stop_nodes
from tests.conftest import (
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
# notice about every failure.preemption_check_s (1 s), so the notice reaches them within
# ~6 s; these jobs have 30 s or more of steps left when the node is preempted.
BOOSTING = ["data=synthetic", "data.rows=50000", "trainer.num_boost_round=1200"]
JOBS = {
    # The PyTorch trainer with its state sharded (every rank writes its own shard at the
    # notice); DDP's replicated state is the user's own loop of the drain test below.
    "fsdp": ["trainer=fsdp", "trainer.epochs=300"],
    "mwms": ["trainer=mwms", "trainer.epochs=150"],
    "xgboost": ["trainer=xgboost", "trainer.max_depth=4", *BOOSTING],
    "lightgbm": ["trainer=lightgbm", "trainer.num_leaves=15", *BOOSTING],
}
# The user's own loop (tests/user_project, run from a folder of its own) on the worker API.
USER_FUNCTION = ["trainer=function", "trainer.fn=mypkg.train:main", "+trainer.steps=6600"]
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
    return start_run(run_dir, f"cluster.address={head.address}",
                     f"storage.uri={run_dir.parent / 'ckpt'}", "checkpoint.every_steps=500",
                     "checkpoint.keep=0", "cluster.cpus_per_worker=1", *job,
                     **({"cwd": cwd} if cwd else {}))


def running(run_dir) -> dict:
    return wait_for(lambda r: r.get("steps", 0) > 20 and len(r.get("workers", [])) == 2, run_dir)


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
            node = node_of(rec["workers"][0]["pid"], nodes)
            assert node is not None and node is node_of(rec["workers"][1]["pid"], nodes)
            preempted.add(node)
        assert len(preempted) == 2, "the two jobs share a node"
        for node in preempted:
            nodes.remove(node)
            node.send_signal(signal.SIGTERM)
        nodes.extend(add_node(head, tmp, num_cpus=2, env=NODE_ENV) for _ in range(2))
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


@pytest.mark.slow
def test_ray_drain_node_with_reason_preemption_saves_a_users_own_loop_at_the_notice(
        preemptible_cluster, tmp_path):
    """The notice reaches a user's own training function (ctx.should_preempt), which saves
    every rank's files at that step and returns; the restart loses no step."""
    head, tmp, nodes = preemptible_cluster
    proc = start_job(head, tmp_path / "run", USER_FUNCTION, cwd=user_project(tmp_path))
    rec = running(tmp_path / "run")
    node_id = rec["workers"][0]["node"]
    drained = node_of(rec["workers"][0]["pid"], nodes)
    drain = subprocess.run(
        [RAY, "drain-node", f"--address={head.address}", f"--node-id={node_id}",
         "--reason=DRAIN_NODE_REASON_PREEMPTION", "--reason-message=spot instance reclaimed",
         f"--deadline-remaining-seconds={DRAIN_DEADLINE_S}"],
        env=node_env(), capture_output=True, text=True, timeout=120)
    assert drain.returncode == 0, drain.stdout + drain.stderr  # the other node has room
    try:
        rec, out = finish(proc, tmp_path / "run")
    finally:
        # `ray drain-node` does not take the node away; the cloud would, at the deadline.
        nodes.remove(drained)
        stop_head(drained)
    notice = assert_saved_at_the_notice(rec, out)
    assert notice["nodes"] == [node_id]
    assert rec["trainer"] == "function" and rec["metrics"]["accuracy"] > 0.9
    assert all(w["node"] != node_id for w in rec["workers"])  # the restart avoided it
