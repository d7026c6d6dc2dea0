"""Elastic training on a real multi-node Ray cluster: a node dies, the job goes on smaller;
room comes back, it grows again; the result does not depend on the sizes it ran at."""

from __future__ import annotations

import os
import signal

import pytest

from tests.conftest import add_node, run_cli, start_head, stop_head
from tests.test_faults import read_record, start_run, wait_for


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray-elastic")
    head = start_head(tmp, num_cpus=0)  # training workers live on the nodes
    nodes = [add_node(head, tmp, num_cpus=2), add_node(head, tmp, num_cpus=2)]
    yield head, tmp, nodes
    for proc in nodes:
        stop_head(proc)
    stop_head(head.process)


@pytest.mark.slow
def test_losing_a_node_shrinks_the_job_and_new_room_grows_it_back(two_node_cluster, tmp_path):
    head, tmp, nodes = two_node_cluster
    common = [f"cluster.address={head.address}", "cluster.workers=4", "cluster.cpus_per_worker=1",
              "trainer.epochs=300", "checkpoint.every_steps=200"]
    proc = start_run(tmp_path / "elastic", *common, f"storage.uri={tmp_path / 'ckpt'}",
                     "cluster.min_workers=2", "cluster.resize_check_s=5", "run.name=elastic")
    wait_for(lambda r: r.get("steps", 0) > 100 and len(r.get("workers", [])) == 4,
             tmp_path / "elastic")
    os.killpg(nodes[0].pid, signal.SIGKILL)  # the node and its workers vanish at once
    wait_for(lambda r: any(w["size"] == 2 for w in r.get("world_sizes", [])), tmp_path / "elastic")
    nodes.append(add_node(head, tmp, num_cpus=2))  # room for two more workers
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    rec = read_record(tmp_path / "elastic")
    sizes = [w["size"] for w in rec["world_sizes"]]
    assert sizes[0] == 4 and 2 in sizes and sizes[-1] == 4 and sizes.index(2) < len(sizes) - 1, sizes
    assert min(sizes) >= 2  # never below cluster.min_workers

    # The same job at a fixed size of 4: the global batch and data order did not change with
    # the world size, so the result is the same within 1%.
    fixed = run_cli(tmp_path / "fixed", *common, f"storage.uri={tmp_path / 'ckpt'}", "run.name=fixed")
    assert fixed.returncode == 0, fixed.output[-4000:]
    a, b = rec["metrics"]["test_accuracy"], fixed.record["metrics"]["test_accuracy"]
    assert abs(a - b) <= 0.01, (a, b)
