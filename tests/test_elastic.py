"""Elastic training on a real multi-node Ray cluster: a node dies, the job goes on smaller;
room comes back, it grows again; the result does not depend on the sizes it ran at."""

from __future__ import annotations

import os
import signal

import pytest

from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.storage import StorageSpec
from scripts.local_cluster import node_of
from tests.conftest import (
    add_node,
    read_record,
    run_cli,
    start_head,
    start_run,
    stop_cluster,
    stop_head,
    wait_for,
)


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray-elastic")
    head = start_head(tmp, num_cpus=0)  # training workers live on the nodes
    nodes = [add_node(head, tmp, num_cpus=2), add_node(head, tmp, num_cpus=2)]
    yield head, tmp, nodes
    for proc in nodes:
        stop_head(proc)
    stop_cluster(head)


def nodes_up(head, tmp, nodes: list, count: int = 2) -> None:
    """The tests share the module's cluster and kill nodes: bring it back to `count` nodes."""
    nodes[:] = [n for n in nodes if n.poll() is None]
    while len(nodes) < count:
        nodes.append(add_node(head, tmp, num_cpus=2))


@pytest.mark.slow
def test_losing_a_node_shrinks_a_sharded_job_and_new_room_grows_it_back(two_node_cluster, tmp_path):
    """FSDP: the state sharded 4 ways is resharded 2 ways from the newest checkpoint (DCP),
    then 4 ways again; the global batch, hence the result, does not depend on the sizes."""
    head, tmp, nodes = two_node_cluster
    nodes_up(head, tmp, nodes)
    # 6600 steps of at least 8 ms: after the shrink, a minute or more for the new node to
    # join and the job to grow back (at full speed the 2 workers finished first).
    common = [f"cluster.address={head.address}", "cluster.workers=4", "cluster.cpus_per_worker=1",
              "trainer=fsdp", "trainer.epochs=300", "checkpoint.every_steps=200", "checkpoint.keep=0",
              "trainer.fn=tests.user_trainers:paced_ddp"]
    proc = start_run(tmp_path / "elastic", *common, f"storage.uri={tmp_path / 'ckpt'}",
                     "cluster.min_workers=2", "cluster.resize_check_s=5", "run.name=elastic")
    wait_for(lambda r: r.get("checkpoints") and len(r.get("workers", [])) == 4,
             tmp_path / "elastic")  # a 4-way sharded checkpoint to shrink from
    os.killpg(nodes[0].pid, signal.SIGKILL)  # the node and its workers vanish at once
    wait_for(lambda r: any(w["size"] == 2 for w in r.get("world_sizes", [])), tmp_path / "elastic")
    nodes.append(add_node(head, tmp, num_cpus=2))  # room for two more workers
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    rec = read_record(tmp_path / "elastic")
    sizes = [w["size"] for w in rec["world_sizes"]]
    assert sizes[0] == 4 and 2 in sizes and sizes[-1] == 4 and sizes.index(2) < len(sizes) - 1, sizes
    assert min(sizes) >= 2  # never below cluster.min_workers
    store = CheckpointStore(StorageSpec(rec["checkpoint_uri"]))
    shrunk = rec["world_sizes"][sizes.index(2)]["step"]  # resumed from a 4-way sharded checkpoint
    assert shrunk > 0 and store.read_manifest(store.ref(shrunk))["world_size"] == 4

    # The same job at a fixed size of 4: the global batch and data order did not change with
    # the world size, so the result is the same within 1%.
    fixed = run_cli(tmp_path / "fixed", *common, f"storage.uri={tmp_path / 'ckpt'}", "run.name=fixed")
    assert fixed.returncode == 0, fixed.output[-4000:]
    a, b = rec["metrics"]["test_accuracy"], fixed.record["metrics"]["test_accuracy"]
    assert abs(a - b) <= 0.01, (a, b)


# Long enough that a node dies mid-run (~20 s of rounds at 4 workers on 2 cores).
BOOSTING = ["data=synthetic", "data.rows=50000", "trainer.num_boost_round=800",
            "checkpoint.every_steps=100", "cluster.workers=4", "cluster.cpus_per_worker=1"]
# The same rows and rounds at any size; what changes with the sharding is where each worker's
# sketch puts the histogram bins, so the trees after a resize differ a little. The test set
# (10,000 rows) measures accuracy to about +-0.0016 (one standard error at 0.975).
BOOSTING_TOLERANCE = 0.005


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["xgboost", "lightgbm"])
def test_boosting_goes_on_with_its_data_resharded_over_the_workers_left(two_node_cluster, tmp_path,
                                                                       trainer):
    head, tmp, nodes = two_node_cluster
    nodes_up(head, tmp, nodes)
    common = [f"cluster.address={head.address}", f"storage.uri={tmp_path / 'ckpt'}",
              f"trainer={trainer}", *BOOSTING]
    fixed = run_cli(tmp_path / "fixed", *common, "run.name=fixed")  # 4 workers throughout
    assert fixed.returncode == 0, fixed.output[-4000:]
    assert [w["size"] for w in fixed.record["world_sizes"]] == [4]

    proc = start_run(tmp_path / "elastic", *common, "cluster.min_workers=2",
                     "cluster.resize_check_s=5", "run.name=elastic")
    rec = wait_for(lambda r: r.get("checkpoints") and len(r.get("workers", [])) == 4,
                   tmp_path / "elastic")
    victim = node_of(rec["workers"][0]["pid"], nodes)
    nodes.remove(victim)
    os.killpg(victim.pid, signal.SIGKILL)  # the node and its two workers vanish at once
    out, _ = proc.communicate(timeout=900)
    victim.wait()
    assert proc.returncode == 0, out[-4000:]
    rec = read_record(tmp_path / "elastic")
    assert [w["size"] for w in rec["world_sizes"]] == [4, 2], rec["world_sizes"]
    resumed_at = rec["world_sizes"][1]["step"]
    assert resumed_at > 0 and resumed_at in [c["step"] for c in rec["checkpoints"]]
    assert rec["steps"] == 800 and 0 <= rec["lost_steps"] <= 100  # one checkpoint interval

    a, b = rec["metrics"], fixed.record["metrics"]
    for name in ("test_accuracy", "test_auc"):
        assert abs(a[name] - b[name]) <= BOOSTING_TOLERANCE, (name, a[name], b[name])
