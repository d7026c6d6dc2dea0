"""The run record's arithmetic, and that secrets never reach it."""

from __future__ import annotations

import json

import pytest

from orchestrator.config.schema import ClusterConfig
from orchestrator.driver.record import REDACTED, RunRecord, redact
from orchestrator.driver.scaling import cpus_per_worker, scaling_kwargs, unplaceable_here


def test_restarts_and_lost_steps():
    rec = RunRecord("r", "ddp", {}, "/ck", started_at=100.0)
    rec.group_started(2, 0, 110.0)
    rec.progress(1, 64, {"loss": 1.0}, 111.0)
    rec.progress(37, 64 * 36, {"loss": 0.5}, 112.0)
    rec.group_started(2, 30, 120.0)  # restarted from the checkpoint at step 30
    rec.progress(50, 64 * 20, {"loss": 0.4}, 125.0)
    rec.finish("succeeded", None, 126.0)
    assert rec.restarts == 1 and rec.lost_steps == 7
    assert [w["step"] for w in rec.world_sizes] == [0, 30]
    assert rec.time_to_first_step_s == 11.0 and rec.wall_s == 26.0
    assert rec.samples_per_s == 64 * 36 / 1.0  # the first group's: the second has one report


def test_steady_rate_leaves_out_each_groups_first_step():
    rec = RunRecord("r", "ddp", {}, "/ck", started_at=100.0)
    rec.group_started(2, 0, 110.0)
    rec.progress(1, 64, {}, 120.0)  # the first step: start-up and warm-up, left out
    assert rec.samples_per_s is None and rec.world_sizes[0]["first_step_at_s"] == 20.0
    rec.progress(11, 640, {}, 121.0)
    assert rec.samples_per_s == 640.0
    rec.group_started(2, 10, 130.0)  # a restart: the rate starts over with the new group
    rec.progress(11, 64, {}, 140.0)
    rec.progress(21, 1280, {}, 142.0)
    assert rec.samples_per_s == 640.0 and rec.world_sizes[1]["first_step_at_s"] == 40.0


def test_a_resize_is_not_a_restart():
    rec = RunRecord("r", "ddp", {}, "/ck")
    rec.group_started(4, 0, rec.started_at)
    rec.group_started(2, 0, rec.started_at)
    assert rec.restarts == 0 and [w["size"] for w in rec.world_sizes] == [4, 2]


def test_redact_hides_secret_keys(tmp_path):
    config = {"storage": {"secret_key": "S3CR3T", "uri": "s3://b"}, "x": [{"token": "t"}]}
    rec = RunRecord("r", "ddp", redact(config), "/ck")
    rec.write(str(tmp_path / "run.json"))
    text = (tmp_path / "run.json").read_text()
    assert "S3CR3T" not in text and json.loads(text)["config"]["storage"]["secret_key"] == REDACTED


def test_run_json_is_strict_json_whatever_the_metrics(tmp_path):
    """A NaN metric (trainer.allow_nonfinite_loss=true) was written as a bare NaN, which jq
    and JSON.parse refuse: it is null."""
    rec = RunRecord("r", "ddp", {}, "/ck")
    rec.progress(3, 12, {"loss": float("nan")}, 10.0)
    rec.worker_finished(3, {"test_loss": float("inf"), "test_accuracy": 0.5}, 11.0)
    rec.write(str(tmp_path / "run.json"))

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    written = json.loads((tmp_path / "run.json").read_text(), parse_constant=refuse)
    assert written["metrics"] == {"test_loss": None, "test_accuracy": 0.5}
    assert written["train_metrics"] == {"loss": None}


def test_cpu_share_is_automatic_and_fractional():
    assert cpus_per_worker(ClusterConfig(workers=2), 2.0) == 1.0
    assert cpus_per_worker(ClusterConfig(workers=16), 2.0) == 0.12
    assert cpus_per_worker(ClusterConfig(workers=1), 8.0) == 1.0
    assert cpus_per_worker(ClusterConfig(workers=4, cpus_per_worker=0.3), 2.0) == 0.3


def test_elastic_scaling_asks_for_a_range():
    kwargs = scaling_kwargs(ClusterConfig(workers=8, min_workers=2, resize_check_s=5), 2.0)
    assert kwargs["num_workers"] == (2, 8) and kwargs["elastic_resize_monitor_interval_s"] == 5
    assert scaling_kwargs(ClusterConfig(workers=3), 2.0)["num_workers"] == 3
    assert scaling_kwargs(ClusterConfig(workers=3), 2.0)["placement_strategy"] == "PACK"
    assert scaling_kwargs(ClusterConfig(placement="SPREAD"), 2.0)["placement_strategy"] == "SPREAD"
    extra = scaling_kwargs(ClusterConfig(resources={"big_memory": 1.0}), 2.0)["resources_per_worker"]
    assert extra == {"CPU": 1.0, "big_memory": 1.0}


@pytest.mark.parametrize("cluster, named", [
    (ClusterConfig(workers=3, cpus_per_worker=1.0), "cluster.cpus_per_worker=1.0 "),
    (ClusterConfig(workers=4, min_workers=3, cpus_per_worker=1.0), "3 workers (cluster.min_workers)"),
    (ClusterConfig(gpus_per_worker=1.0), "cluster.gpus_per_worker=1.0 "),
    (ClusterConfig(resources={"big_memory": 1.0}), "cluster.resources.big_memory=1.0 "),
    (ClusterConfig(workers=300), "cluster.workers=300 "),  # 0.01 CPU each at least
])
def test_an_embedded_clusters_refusal_names_the_key_that_asks_too_much(cluster, named):
    """An embedded cluster (one node, nothing to grow into): what it cannot hold is refused
    at once instead of waited for until cluster.placement_timeout_s."""
    per_worker = scaling_kwargs(cluster, 2.0)["resources_per_worker"]
    line = unplaceable_here(cluster, per_worker, {"CPU": 2.0, "memory": 1e9})
    assert line is not None and named in line and "\n" not in line, line
    assert unplaceable_here(cluster, per_worker, {"CPU": 1000.0, "GPU": 1000.0,
                                                  "big_memory": 1000.0}) is None


def test_what_an_embedded_cluster_holds_is_not_refused():
    for cluster in (ClusterConfig(), ClusterConfig(workers=16), ClusterConfig(workers=2, cpus_per_worker=1.0),
                    ClusterConfig(workers=8, min_workers=2, cpus_per_worker=1.0)):
        per_worker = scaling_kwargs(cluster, 2.0)["resources_per_worker"]
        assert unplaceable_here(cluster, per_worker, {"CPU": 2.0}) is None, cluster
    cpus = unplaceable_here(ClusterConfig(workers=3, cpus_per_worker=1.0), {"CPU": 1.0}, {"CPU": 2.0})
    assert cpus.endswith("at most 0.66 with 3 workers, or null to split them")


def test_ranks_failing_alike_in_one_group_are_not_a_repeat():
    from orchestrator.driver.failure_policy import WorkerError

    rec = RunRecord("r", "ddp", {}, "/ck")
    for rank in (0, 1):
        rec.worker_started(rank, 100 + rank, "node")
    same = [WorkerError(r, 265, "RuntimeError", "Connection reset by peer", "tb") for r in (1, 3)]
    assert not rec.worker_error(same[0]).permanent
    assert not rec.worker_error(same[1]).permanent  # the same group: collateral, not a repeat
    for rank in (0, 1):
        rec.worker_started(rank, 200 + rank, "node")  # the next group
    assert rec.worker_error(same[0]).permanent and rec.permanent_error.startswith("worker rank 1")


def test_the_last_groups_failures_of_a_failed_run_say_they_were_not_retried():
    """A failure judged worth a retry in the group that ended a failed run (its restarts used
    up) is recorded as not retried; those before it were retried."""
    from orchestrator.driver.failure_policy import WorkerError

    rec = RunRecord("r", "ddp", {"failure": {"max_restarts": 1}}, "/ck")
    for attempt, step in ((1, 10), (2, 20)):
        for rank in (0, 1):
            rec.worker_started(rank, 100 * attempt + rank, "node")
        rec.group_started(2, 0, float(attempt))  # the second: a restart
        rec.worker_error(WorkerError(1, step, "RuntimeError", f"lost at {step}", "tb"))
    rec.finish("failed", "training failed", 2.0)
    first, last = (f["decision"] for f in rec.failures)
    assert first == "RETRY, since RuntimeError at step 10 is new"
    assert last == ("NOT RETRIED, since all 1 restarts of failure.max_restarts were used "
                    "(RuntimeError at step 20: new)"), last


def test_a_repeat_is_counted_in_attempts_not_in_ranks():
    """Two attempts whose two ranks each failed alike: "2 times", not 3 (measured on a GPU:
    both ranks of each attempt raised the same NCCL error)."""
    from orchestrator.driver.failure_policy import WorkerError

    rec = RunRecord("r", "ddp", {}, "/ck")
    for attempt in (1, 2):
        for rank in (0, 1):
            rec.worker_started(rank, 100 * attempt + rank, "node")
        verdicts = [rec.worker_error(WorkerError(rank, 0, "DistBackendError",
                                                 "Duplicate GPU detected", "tb")) for rank in (0, 1)]
    assert verdicts[0].permanent
    assert "happened 2 times in a row of restarts" in verdicts[0].reason, verdicts[0].reason


def test_a_ray_that_does_not_start_is_one_line(monkeypatch):
    import subprocess

    import ray

    from orchestrator.config.schema import ClusterConfig
    from orchestrator.driver.ray_session import RaySession
    from orchestrator.errors import ConfigError

    started = []

    def broken(**kwargs):  # as Ray's: processes started (a GCS, an agent), then the error
        started.append(subprocess.Popen(["sleep", "600"]))
        raise RuntimeError("The current node timed out during startup.\nTraceback (most recent "
                           "call last):\n...")

    monkeypatch.setattr(ray, "init", broken)
    try:
        RaySession(ClusterConfig(dashboard_port=0)).__enter__()
    except ConfigError as exc:
        message, code = str(exc), exc.exit_code
    # the machine's failure, not the input's: exit 1, and what to do
    assert code == 1 and "\n" not in message, message
    assert message.startswith("cluster: Ray did not start on this machine in 0 s (RuntimeError: "
                              "The current node timed out during startup.); the machine may be "
                              "too busy (load average "), message
    assert message.endswith("run the command again when it is less busy, or start Ray yourself "
                            "(`ray start --head`) and join it with cluster.address=auto"), message
    # what the failed start left running is gone (Ray stops none of it)
    assert started[0].wait(timeout=30) == -9
    # The embedded start made this process adopt orphans; with no session to close, it adopts
    # no more (it did: every daemon a later test's command started became this process's
    # zombie, and `python -m orchestrator.service stop` waited 60 s for one to end).
    assert not adopts_orphans()


def test_a_port_chosen_for_a_server_is_held_until_it_starts_and_two_choices_never_meet():
    """driver/ports.py: a command's dashboard starts seconds after its port was chosen; a
    second command choosing meanwhile, and Ray's own check (SO_REUSEADDR), find it taken."""
    import socket

    from orchestrator.driver.ports import PortHold

    first = PortHold(0)
    second = PortHold(first.port)  # asks for the same port: gets another
    assert second.port != first.port

    def binds(port: int) -> bool:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
            return True

    assert not binds(first.port)
    first.release()
    first.release()  # again: nothing
    assert binds(first.port)  # the server binds it now
    second.release()


def adopts_orphans() -> bool:
    import ctypes

    value = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(37, ctypes.byref(value), 0, 0, 0)  # GET_CHILD_SUBREAPER
    return value.value == 1


def test_a_lost_recorder_is_one_line_and_run_json_keeps_what_it_last_wrote(tmp_path, capsys):
    """The recorder actor died mid-run (its node, or the cluster took the driver for dead):
    exit code 1 from one `error:` line, and run.json finished as failed over the progress the
    recorder had written (not a traceback, not a record stuck at 'running')."""
    from orchestrator.driver.launch import recorder_lost

    path = tmp_path / "run.json"
    at_start = RunRecord("r", "ddp", {}, "/ck", started_at=100.0)
    written = RunRecord("r", "ddp", {}, "/ck", started_at=100.0)
    written.group_started(2, 0, 110.0)
    written.progress(40, 640, {"loss": 0.5}, 120.0)
    written.write(str(path))
    death = RuntimeError("The actor died unexpectedly before finishing this task.\n"
                         "\tclass_name: RunRecorder\nThe actor never ran - it was cancelled.")
    final = recorder_lost(death, path, at_start)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the run's recorder ended: The actor died")
    on_disk = json.loads(path.read_text())
    assert on_disk["status"] == final["status"] == "failed" and on_disk["steps"] == 40
    assert on_disk["error"].endswith("it was cancelled.") and on_disk["wall_s"] > 0

    path.unlink()  # nothing written yet: the record as the run began
    assert recorder_lost(death, path, at_start)["steps"] == 0
    assert json.loads(path.read_text())["status"] == "failed"


def test_a_repeated_failure_is_one_line_and_one_after_the_last_step_says_training_is_kept():
    """The failure that repeated is one line on the terminal and in run.json's error (the
    traceback stays in permanent_error); one raised after the last training step (its
    evaluation) says that the final checkpoint holds the training and the same command only
    runs what comes after it."""
    from orchestrator.driver.failure_policy import WorkerError

    def failing(rec: RunRecord, step: int) -> str | None:
        for group in range(2):  # the same error in two worker groups in a row: permanent
            rec.group_started(2, step, 110.0 + group)
            rec.worker_started(0, 1000 + group, "n")
            rec.worker_error(WorkerError(0, step, "KeyError", "'sse'", "Traceback (most...)\n  x",
                                         pid=1000 + group))
        return rec.failure_line()

    mid = RunRecord("r", "ddp", {}, "/ck", total_steps=640)
    line = failing(mid, 320)
    assert line == ("training failed permanently (the same error repeated after a restart), "
                    "worker rank 0 at step 320: KeyError: 'sse' (traceback: run.json permanent_error)")
    assert "Traceback" in mid.permanent_error

    after = RunRecord("r", "ddp", {}, "/ck", total_steps=640)
    after.checkpoint(640, "/ck/step_000000640", 10, 0.1, 0.1)
    line = failing(after, 640)
    assert line.startswith("the run failed after its last training step") and "\n" not in line
    assert "the checkpoint at step 640 is committed: the same command resumes there" in line

    assert RunRecord("r", "ddp", {}, "/ck").failure_line() is None

    nan = RunRecord("r", "ddp", {}, "/ck", total_steps=640)  # not retried: stops the first time
    nan.group_started(2, 0, 110.0)
    assert nan.worker_error(WorkerError(0, 50, "NonFiniteLoss", "the training loss is nan",
                                        "Traceback", retry=False)).permanent
    assert nan.failure_line().startswith("training failed permanently (NonFiniteLoss is not "
                                         "retried), worker rank 0 at step 50")


def test_a_dataloader_process_error_is_the_users_own_words():
    """torch re-raises a DataLoader process's exception with its traceback as the message; the
    console's one line said only 'Caught IndexError in DataLoader worker process 1.'."""
    from torch.utils.data import DataLoader, Dataset

    from orchestrator.errors import one_line

    class Bad(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            if i == 5:
                raise IndexError("bad row 5")
            return i

    with pytest.raises(IndexError) as err:
        list(DataLoader(Bad(), num_workers=1))
    assert one_line(err.value) == "bad row 5 (in DataLoader worker process 0)"
    assert one_line(ValueError("plain")) == "plain"


def test_every_failed_group_is_a_restart_a_shrink_after_a_loss_and_an_early_one_too():
    """A lost node's shrink read as a resize (restarts 0 where Ray had spent two), and a group
    that failed before its first step was not counted at all."""
    rec = RunRecord("r", "ddp", {}, "/ck")

    def group(size: int) -> None:  # its workers start (each says so as it starts)
        for rank in range(size):
            rec.worker_started(rank, 1000 * len(rec.world_sizes) + rank, "node")

    group(4)
    rec.group_failed()  # the first group dies while it restores: it never said it started
    group(4)
    assert rec.group_started(4, 0, 1.0) == "restart" and rec.restarts == 1
    for _ in range(3):  # Ray Train tells it at every poll while the failure lasts
        rec.group_failed()  # a node lost
    group(2)
    assert rec.group_started(2, 100, 2.0) == "restart" and rec.restarts == 2
    group(4)
    assert rec.group_started(4, 200, 3.0) == "resize" and rec.restarts == 2  # new room
    rec.group_failed()
    group(4)
    rec.group_failed()  # the next group failed again before announcing itself
    group(4)
    assert rec.group_started(4, 200, 4.0) == "restart" and rec.restarts == 4


def test_the_failure_line_names_the_rank_that_died_not_the_one_that_lost_it():
    from types import SimpleNamespace

    from orchestrator.driver.launch import describe_failure

    echo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:21414: Connection reset by peer")
    died = RuntimeError("Worker health check failed: the actor died (OOM killed)")
    both = SimpleNamespace(worker_failures={0: echo, 1: died})
    assert describe_failure(both) == "worker rank 1: RuntimeError: Worker health check failed: " \
        "the actor died (OOM killed)"
    assert describe_failure(SimpleNamespace(worker_failures={0: echo})).startswith("worker rank 0")


def test_a_dead_peers_traceback_is_one_line_on_the_console_and_others_stay_whole():
    """trainer=script: when rank 1 is killed, rank 0 fails in its next collective with ~25
    lines of gloo traceback that only say the peer is gone (issue 61, 5); the console gets its
    last line, the rank's log keeps all. A traceback of the script's own stays whole."""
    from orchestrator.observe.tracebacks import ConsoleTracebacks

    gloo = ["Traceback (most recent call last):", '  File "train.py", line 40, in <module>',
            *[f"    frame {i}" for i in range(20)],
            "torch.distributed.DistBackendError: [../third_party/gloo/gloo/transport/tcp/"
            "pair.cc:534] Read error [127.0.0.1]:41212: Connection reset by peer"]
    own = ["Traceback (most recent call last):", '  File "train.py", line 12, in <module>',
           "ValueError: no such column"]
    console = ConsoleTracebacks()
    shown = console.feed(["epoch 3", *gloo[:10]])  # held until its last line comes
    assert shown == ["epoch 3"]
    shown = console.feed([*gloo[10:], "after", *own])
    assert shown == [f"{gloo[-1]}  (22 lines of its traceback, a peer rank gone, are in this "
                     "rank's log)", "after", *own]
    assert console.feed(["Traceback (most recent call last):", "  File"]) == []
    assert console.flush() == ["Traceback (most recent call last):", "  File"]  # at the end


def test_a_controller_destroyed_with_its_placement_group_is_a_stopped_trial_not_a_failure():
    """ASHA stops a sweep's trial: Tune removes the trial's placement group, Ray destroys the
    controller in it, and the trial's run said `error: Ray Train's controller ended: ...` and
    recorded failed. Now: status stopped, no error line (launch.run_to_end)."""
    from ray.exceptions import RayActorError

    from orchestrator.driver.interrupts import DeferredInterrupt
    from orchestrator.driver.launch import run_to_end

    class Trainer:
        def __init__(self, message):
            self.message = message

        def fit(self):
            raise RayActorError(error_msg=self.message)

    removed = "The actor is dead because its worker process has died. Worker exit type: " \
              "INTENDED_SYSTEM_EXIT Worker exit detail: Destroying worker since its placement " \
              "group was removed."
    assert run_to_end(Trainer(removed), DeferredInterrupt(), False, None) == \
        (1, "stopped", "stopped early by the sweep's scheduler")
    code, status, error = run_to_end(Trainer("The actor died: OOM"), DeferredInterrupt(), False,
                                     None)
    assert (code, status) == (1, "failed") and error.startswith("Ray Train's controller ended")


def test_a_worker_that_told_nothing_is_a_failure_until_its_own_report_arrives():
    """Ray Train's word on a killed or cut-off worker is recorded (a restart always has its
    failure); the worker's own report, if it arrives late, replaces it; it is retried, and
    says it was not when the run failed there."""
    from orchestrator.driver.failure_policy import WorkerError

    rec = RunRecord("r", "ddp", {"failure": {"max_restarts": 1}}, "/ck")
    for rank in (0, 1):
        rec.worker_started(rank, 100 + rank, "node")
    rec.group_started(2, 0, 1.0)
    rec.steps = 250
    rec.worker_lost(0, "ActorDiedError: The actor died unexpectedly")
    rec.worker_lost(1, "WorkerHealthCheckFailedError: no answer in 10 s")
    assert [(f["rank"], f["error"], f["pid"], f["lost"]) for f in rec.failures] == \
        [(0, "ActorDiedError", 100, True), (1, "WorkerHealthCheckFailedError", 101, True)]
    rec.worker_error(WorkerError(1, 250, "DistBackendError", "timed out", "tb", pid=101))
    assert [(f["rank"], f["error"]) for f in rec.failures] == \
        [(0, "ActorDiedError"), (1, "DistBackendError")]
    rec.finish("failed", "training failed", 2.0)
    assert rec.failures[0]["decision"] == (
        "NOT RETRIED, since the run stopped (the worker was lost and told nothing itself)"), \
        rec.failures[0]["decision"]


def test_a_skipped_write_of_the_record_is_done_at_the_next_poll_past_the_interval():
    """A report within a second of the last write is not written at once; if none follows (a
    run held at a step, a long evaluation), the driver's next poll past the second writes it:
    run.json never stays behind what the console shows."""
    from orchestrator.driver.recorder import WriteThrottle

    now = [10.0]
    writes = WriteThrottle(1.0, clock=lambda: now[0])
    assert writes.due() and not writes.skipped  # the first write
    now[0] = 10.4
    assert not writes.due() and writes.skipped  # a report within the second: held back
    now[0] = 10.9
    assert not writes.due() and writes.skipped  # a poll within the second: still held
    now[0] = 11.1
    assert writes.skipped and writes.due() and not writes.skipped  # the poll past it writes
    assert writes.due(force=True)  # a group's start, a checkpoint: at once
