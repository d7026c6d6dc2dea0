"""Elastic training on a real multi-node Ray cluster: a node dies, the job goes on smaller;
room comes back, it grows again; the result does not depend on the sizes it ran at.

The PyTorch job holds at a step while a gate file exists (tests/user_trainers.py), so it
outlasts the shrink and the grow-back however fast the machine is, then finishes at once."""

from __future__ import annotations

import os
import signal

import pytest

from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.storage.location import StorageSpec
from scripts.local_cluster import node_of, stop_nodes
from tests.conftest import (
    REPO,
    add_node,
    read_record,
    start_head,
    start_run,
    stop_cluster,
    user_project,
    wait_for,
)
from tests.helpers import digits_parquet, rows_per_step

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray-elastic")
    head = start_head(tmp, num_cpus=0)  # training workers live on the nodes
    nodes = [add_node(head, tmp, num_cpus=2, resources=NODE_RESOURCES) for _ in range(2)]
    yield head, tmp, nodes
    stop_nodes(nodes)
    stop_cluster(head)


# Every node also offers 2 of a resource per boosting job: each job's workers ask for 1, so a
# node holds 2 workers of each job, whatever the other job does (CPUs alone would let the
# first job to restart take a surviving node's every CPU).
NODE_RESOURCES = {"xgboost": 2, "lightgbm": 2}


# An elastic job that lost a node can size its new group before Ray has declared the node dead
# (its CPUs still counted): it waits failure.hang_timeout_s (30 s by default) for a placement
# group that cannot be placed, then tries a smaller one. Nothing tested depends on that wait.
SHORT_WAIT = ["failure.hang_timeout_s=10"]


def nodes_up(head, tmp, nodes: list, count: int = 2) -> None:
    """The tests share the module's cluster and kill nodes: bring it back to `count` nodes."""
    nodes[:] = [n for n in nodes if n.poll() is None]
    while len(nodes) < count:
        nodes.append(add_node(head, tmp, num_cpus=2, resources=NODE_RESOURCES))


def kill_node_of(rec: dict, nodes: list):
    """SIGKILL the `ray start` node a worker runs on: the node and its workers vanish at once."""
    victim = node_of(rec["workers"][0], nodes)
    nodes.remove(victim)
    os.killpg(victim.pid, signal.SIGKILL)
    return victim


def reference(ray_head, run_dir, *overrides: str, cwd=REPO):
    """The same job at a fixed size of 2, on the session's one-node cluster: it runs while the
    elastic one is put through its faults. Any fixed size is a reference (the global batch
    does not depend on it); 2 starts half the processes of 4."""
    return start_run(run_dir, f"cluster.address={ray_head.address}", *overrides,
                     "run.name=fixed", "cluster.workers=2", cwd=cwd)


def finished(proc, run_dir) -> dict:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    rec = read_record(run_dir)
    assert [w["size"] for w in rec["world_sizes"]] == [2]  # 2 workers throughout
    return rec


def test_losing_a_node_shrinks_a_sharded_job_and_new_room_grows_it_back(two_node_cluster, ray_head,
                                                                        tmp_path):
    """FSDP on streamed parquet (each worker reads only its share of the row groups): the
    state sharded 4 ways is resharded 2 ways from the newest checkpoint (DCP), then 4 ways
    again; every step trains on the same rows as the fixed-size run's (the ids the model
    logs), so the result does not depend on the sizes."""
    head, tmp, nodes = two_node_cluster
    nodes_up(head, tmp, nodes)
    gate, project = tmp_path / "gate", user_project(tmp_path)
    data = digits_parquet(tmp_path / "data")
    (tmp_path / "ids-elastic").mkdir()
    (tmp_path / "ids-fixed").mkdir()
    job = ["trainer=fsdp", "trainer.epochs=100", "trainer.max_steps=600",
           "data=parquet", f"data.path={data}", "data.stream=true", "data.shards=4",
           "trainer.model._target_=mypkg.ids.LoggingTabular", "~trainer.model.hidden",
           "checkpoint.every_steps=100", "checkpoint.keep=0", f"storage.uri={tmp_path / 'ckpt'}"]
    common = [f"cluster.address={head.address}", "cluster.workers=4", "cluster.cpus_per_worker=1",
              *job, *SHORT_WAIT]
    gate.write_text("hold")
    proc = start_run(tmp_path / "elastic", *common, "cluster.min_workers=2",
                     "cluster.resize_check_s=2", "run.name=elastic",
                     f"+trainer.model.log_dir={tmp_path / 'ids-elastic'}",
                     "trainer.fn=tests.user_trainers:gated_ddp", f"+trainer.gate={gate}",
                     "+trainer.hold_at=500", cwd=project, env={"PYTHONPATH": str(REPO)})
    try:
        wait_for(lambda r: r.get("checkpoints") and len(r.get("workers", [])) == 4,
                 tmp_path / "elastic")  # a 4-way sharded checkpoint to shrink from
        # The reference starts once the elastic job runs (on a 2-core machine, starting both at
        # once only delays the job the test waits on).
        fixed = reference(ray_head, tmp_path / "fixed", *job, "cluster.cpus_per_worker=0.5",
                          f"+trainer.model.log_dir={tmp_path / 'ids-fixed'}", cwd=project)
        kill_node_of(read_record(tmp_path / "elastic"), nodes)
        # Shrunk, and a checkpoint of the 2-way sharded state committed (it holds at 500).
        wait_for(lambda r: [w["size"] for w in r.get("world_sizes", [])][-1:] == [2] and
                 max(c["step"] for c in r["checkpoints"]) > r["world_sizes"][-1]["step"],
                 tmp_path / "elastic")
        nodes.append(add_node(head, tmp, num_cpus=2, resources=NODE_RESOURCES))  # room for 2 more
        wait_for(lambda r: [w["size"] for w in r["world_sizes"]][-1:] == [4] and
                 len(r["world_sizes"]) == 3, tmp_path / "elastic")
    finally:
        gate.unlink()  # the held run finishes
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    rec = read_record(tmp_path / "elastic")
    sizes = [w["size"] for w in rec["world_sizes"]]
    assert sizes == [4, 2, 4], rec["world_sizes"]
    store = CheckpointStore(StorageSpec(rec["checkpoint_uri"]))
    shrunk, grown = rec["world_sizes"][1]["step"], rec["world_sizes"][2]["step"]
    assert shrunk >= 100 and store.read_manifest(store.ref(shrunk))["world_size"] == 4
    assert grown > shrunk and store.read_manifest(store.ref(grown))["world_size"] == 2

    # The same job at a fixed size of 2: the same rows at every step, whatever the sizes the
    # elastic one ran at, so the result is the same within 1%.
    reference_rec = finished(fixed, tmp_path / "fixed")
    rows = rows_per_step(tmp_path / "ids-elastic", rec)
    assert sorted(rows) == list(range(600)) and rows == rows_per_step(tmp_path / "ids-fixed",
                                                                       reference_rec)
    assert rec["data"]["streamed"] and rec["data"]["shards"] == 4
    a, b = rec["metrics"]["test_accuracy"], reference_rec["metrics"]["test_accuracy"]
    assert abs(a - b) <= 0.01, (a, b)


# Held at round 250 (a gate) until both jobs have resumed smaller: the kill lands mid-run
# however fast the machine, and no more rounds are paid for than the test needs.
BOOSTING = ["data=synthetic", "data.rows=50000", "trainer.num_boost_round=300",
            "checkpoint.every_steps=50", "checkpoint.keep=0", "cluster.workers=4"]
ROUNDS, HOLD_AT, EVERY = 300, 250, 50
# The same rows and rounds at any size; what changes with the sharding is where each worker's
# sketch puts the histogram bins, so the trees after a resize differ a little. The test set
# (10,000 rows) measures accuracy to about +-0.0016 (one standard error at 0.975), and both
# runs are measured on the same rows.
BOOSTING_TOLERANCE = 0.005


def test_boosting_goes_on_with_its_data_resharded_over_the_workers_left(two_node_cluster, ray_head,
                                                                       tmp_path):
    """XGBoost and LightGBM at once, each 4 workers spread over both nodes (SPREAD, and a node
    holds 2 of each job's workers): a node killed takes 2 workers of each, and both go on at 2
    from their newest checkpoint."""
    head, tmp, nodes = two_node_cluster
    nodes_up(head, tmp, nodes)
    trainers = ("xgboost", "lightgbm")
    gate = tmp_path / "gate"
    gate.write_text("hold")

    def job(trainer: str) -> list[str]:
        return [f"storage.uri={tmp_path / trainer}", f"trainer={trainer}", *BOOSTING]

    def common(trainer: str) -> list[str]:
        return [f"cluster.address={head.address}", *job(trainer), "cluster.cpus_per_worker=0.5",
                f"+cluster.resources.{trainer}=1", "cluster.placement=SPREAD", *SHORT_WAIT,
                "trainer.fn=tests.user_trainers:gated", f"+trainer.inner=trainers.{trainer}.train:main",
                f"+trainer.gate={gate}", f"+trainer.hold_at={HOLD_AT}", "+trainer.pace_s=0.001"]

    elastic = {t: start_run(tmp_path / f"elastic-{t}", *common(t), "cluster.min_workers=2",
                            "cluster.resize_check_s=2", "run.name=elastic") for t in trainers}
    try:
        records = {t: wait_for(lambda r: r.get("checkpoints") and len(r.get("workers", [])) == 4,
                               tmp_path / f"elastic-{t}") for t in trainers}
        hosts = {t: {node_of(w, nodes) for w in rec["workers"]} for t, rec in records.items()}
        assert all(len(h) == 2 for h in hosts.values()), hosts  # spread over both nodes
        # The references start once the elastic jobs run, as in the test above.
        fixed = {t: reference(ray_head, tmp_path / f"fixed-{t}", *job(t), "cluster.cpus_per_worker=0.25")
                 for t in trainers}
        victim = kill_node_of(records["xgboost"], nodes)
        for trainer in trainers:
            wait_for(lambda r: len(r.get("world_sizes", [])) == 2, tmp_path / f"elastic-{trainer}")
    finally:
        gate.unlink()  # the held runs finish
    for proc in elastic.values():
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-4000:]
    victim.wait()
    for trainer in trainers:
        rec = read_record(tmp_path / f"elastic-{trainer}")
        assert [w["size"] for w in rec["world_sizes"]] == [4, 2], (trainer, rec["world_sizes"])
        resumed_at = rec["world_sizes"][1]["step"]
        assert resumed_at > 0 and resumed_at in [c["step"] for c in rec["checkpoints"]]
        assert rec["steps"] == ROUNDS and 0 <= rec["lost_steps"] <= EVERY  # one interval
        a, b = rec["metrics"], finished(fixed[trainer], tmp_path / f"fixed-{trainer}")["metrics"]
        for name in ("test_accuracy", "test_auc"):
            assert abs(a[name] - b[name]) <= BOOSTING_TOLERANCE, (trainer, name, a[name], b[name])
