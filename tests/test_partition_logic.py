"""Pure decisions for network partitions: a late report is not a repeat; an elastic job gives
up on a placement group Ray's stale view promised after the hang timeout."""

from __future__ import annotations

from orchestrator.config.schema import ClusterConfig
from orchestrator.driver.failure_policy import WorkerError
from orchestrator.driver.record import RunRecord
from orchestrator.driver.scaling import elastic_controller_env


def test_a_cut_off_workers_late_report_is_not_a_repeat_of_its_own_groups_error():
    """A partition: the ranks left fail in a collective at step 254; the group is replaced;
    when the link comes back, a cut-off rank of the first group reports the same timeout."""
    rec = RunRecord("r", "ddp", {}, "/ck")
    for rank in range(4):
        rec.worker_started(rank, 100 + rank, "node")
    timeout = "Timed out waiting 10000ms for recv operation to complete"
    assert not rec.worker_error(WorkerError(3, 254, "RuntimeError", timeout, "tb", pid=103)).permanent
    for rank in range(2):
        rec.worker_started(rank, 200 + rank, "node")  # the group of 2 on the other host
    late = WorkerError(1, 254, "RuntimeError", timeout, "tb", pid=101)  # from the first group
    assert not rec.worker_error(late).permanent and rec.permanent_error is None
    again = WorkerError(1, 254, "RuntimeError", timeout, "tb", pid=201)  # the new group: a repeat
    assert rec.worker_error(again).permanent


def test_only_an_elastic_job_gives_up_early_on_a_placement_group():
    elastic = ClusterConfig(workers=4, min_workers=2)
    assert elastic_controller_env(elastic, 10.0) == {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10.0"}
    assert elastic_controller_env(ClusterConfig(workers=4), 10.0) == {}
    assert elastic_controller_env(ClusterConfig(workers=4, min_workers=4), 10.0) == {}
