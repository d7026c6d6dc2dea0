"""Preemption on a real multi-node Ray cluster: the notice makes every worker checkpoint at the
next step boundary and hold until the deadline, so the restart loses no step."""

from __future__ import annotations

import signal

import pytest

from tests.conftest import add_node, start_head, stop_head
from tests.test_faults import read_record, start_run, wait_for


@pytest.fixture(scope="module")
def cluster_without_cpus_on_head(tmp_path_factory):
    """A head that runs no training worker, so the workers live on nodes we can preempt."""
    tmp = tmp_path_factory.mktemp("ray-preemption")
    head = start_head(tmp, num_cpus=0)
    nodes: list = []
    yield head, tmp, nodes
    for proc in nodes:
        stop_head(proc)
    stop_head(head.process)


@pytest.mark.slow
def test_sigterm_to_a_node_saves_before_the_deadline_and_loses_no_step(cluster_without_cpus_on_head, tmp_path):
    head, tmp, nodes = cluster_without_cpus_on_head
    nodes.append(add_node(head, tmp, num_cpus=2))
    proc = start_run(tmp_path / "run", f"cluster.address={head.address}",
                     f"storage.uri={tmp_path / 'ckpt'}", "trainer.epochs=300",
                     "checkpoint.every_steps=500", "cluster.cpus_per_worker=1")
    wait_for(lambda r: r.get("steps", 0) > 50 and len(r.get("workers", [])) == 2, tmp_path / "run")
    nodes[0].send_signal(signal.SIGTERM)  # what a cloud does to a spot VM: Ray drains the node
    nodes.append(add_node(head, tmp, num_cpus=2))  # the replacement capacity
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    rec = read_record(tmp_path / "run")
    assert rec["status"] == "succeeded"
    assert rec["preemptions"] == 1 and rec["restarts"] == 0
    notice = rec["preemption_notices"][0]
    assert notice["deadline_in_s"] > 0 and notice["nodes"]
    # The checkpoint was taken at the notice's step, and the restart began exactly there.
    assert notice["step"] in [c["step"] for c in rec["checkpoints"]]
    assert rec["world_sizes"][1]["step"] == notice["step"]
    assert rec["lost_steps"] == 0
    assert "preemption notice" in out and f"checkpointing at step {notice['step']}" in out
