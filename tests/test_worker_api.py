"""The worker API's decisions on one rank, with a scripted stand-in for Ray's collective and
recorder (their real counterparts run in the end-to-end tests); the checkpoint store and
committer are the real ones, on a local directory."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from orchestrator.checkpoint.store import CheckpointStore, step_dir
from orchestrator.config.schema import CheckpointConfig, DataConfig
from orchestrator.errors import ConfigError, one_line
from orchestrator.storage.location import StorageSpec
from orchestrator.worker.loop import WorkerSpec, start_point
from orchestrator.worker.start import ResumeSourceGone
from orchestrator.worker.training_function import check_training
from orchestrator.worker_api import WorkerContext, WorkerLifecycle
from tests.helpers import stored_path


class Recorder:
    """Takes the actor calls a rank makes (``recorder.x.remote(...)``)."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name):
        calls = self.calls

        class Method:
            @staticmethod
            def remote(*args):
                calls.append((name, args))

        return Method

    def named(self, name):
        return [args for n, args in self.calls if n == name]


@dataclass
class Notice:
    deadline_ms: int
    preempted_node_ids: tuple = ("node-1",)


class OneRank:
    """Rank 0 of a one-worker group; a preemption notice shows up at the n-th check."""

    def __init__(self, notice_at_check: int | None = None):
        self.checks, self.notice_at = 0, notice_at_check

    def broadcast(self, value):
        return value

    def preemption_info(self):
        self.checks += 1
        return Notice(10**15) if self.checks == self.notice_at else None

    def agree(self, proposal):  # as RayCollective: the notice and rank 0's proposal at once
        return self.preemption_info(), self.broadcast(proposal)


def worker_spec(tmp_path: Path, recorder=None, resume_source: Path | None = None,
                **checkpoint) -> WorkerSpec:
    return WorkerSpec("tests.user_trainers:takes_one_argument", {}, DataConfig(),
                      CheckpointConfig(**checkpoint), StorageSpec(str(tmp_path / "run")),
                      StorageSpec(str(resume_source)) if resume_source else None,
                      seed=7, recorder=recorder or Recorder(), preemption_check_s=1.0)


def context(tmp_path: Path, collective=None, recorder=None, **checkpoint) -> WorkerContext:
    spec = worker_spec(tmp_path, recorder, **checkpoint)
    collective = collective or OneRank()
    workdir = tmp_path / f"work{len(list(tmp_path.glob('work*')))}"
    start = start_point(spec, 0, collective, workdir)
    return WorkerContext(spec, 0, 0, 1, [], start, collective, workdir)


def loop(ctx: WorkerContext, until: int) -> list[int]:
    """A loop as the docs show it; returns the steps it saved at."""
    saved = []
    for step in range(ctx.start_step, until):
        ctx.step_done(step + 1, {"loss": 1.0 / (step + 1)}, samples=4)
        if ctx.should_save(step + 1):
            ctx.save(step + 1, lambda d, s=step + 1: (d / "state.txt").write_text(str(s)))
            saved.append(step + 1)
        if ctx.should_preempt():
            break
    WorkerLifecycle(ctx).close()
    return saved


def test_saves_by_policy_and_at_the_end_and_a_new_attempt_restores_the_newest(tmp_path):
    recorder = Recorder()
    ctx = context(tmp_path, recorder=recorder, every_steps=5)
    assert ctx.restore() is None and ctx.start_step == 0
    ctx.total_steps = 12
    assert loop(ctx, 12) == [5, 10, 12]
    assert [args[0] for args in recorder.named("checkpoint")] == [5, 10, 12]
    assert recorder.named("group_started")[0][:2] == (1, 0)

    again = context(tmp_path, every_steps=5)
    assert again.start_step == 12 and (again.restore() / "state.txt").read_text() == "12"
    # The checkpoint's files and manifest only, as from an object store: not its .parts/.
    assert sorted(p.name for p in again.restore().iterdir()) == ["manifest.json", "state.txt"]
    assert not again.should_save(12)  # the checkpoint it resumed from is not taken again


def test_a_run_that_resumes_older_says_so_and_retention_keeps_what_it_writes(tmp_path):
    """Steps 10 and 15 unreadable: the next attempt resumes from 5. Retention went by step, so
    each checkpoint it wrote (6, 8: lower than 10 and 15) was deleted soon after its commit."""
    first = context(tmp_path, every_steps=5, keep=3)
    first.total_steps = 15
    assert loop(first, 15) == [5, 10, 15]
    for step in (10, 15):
        Path(stored_path(tmp_path / "run" / step_dir(step), "state.txt")).write_text("xx")
    recorder = Recorder()
    again = context(tmp_path, recorder=recorder, every_steps=2, keep=3)
    assert again.start_step == 5
    assert any("resumes from step 5, older than the 2 committed checkpoint(s) it could not read:"
               in args[0] for args in recorder.named("warning"))
    again.total_steps = 9
    assert loop(again, 9) == [6, 8, 9]
    store = CheckpointStore(StorageSpec(str(tmp_path / "run")))
    assert [r.step for r in store.committed()] == [5, 6, 8, 9]  # 5: resumed from, protected


def test_a_corrupt_checkpoint_is_written_again_when_training_reaches_its_step(tmp_path):
    """Step 10 found corrupt at the start: it is uncommitted (its manifest set aside, with a
    warning), so the attempt that resumes from 5 writes step 10 again and commits it, instead
    of keeping the corrupt one as committed and skipping its upload."""
    first = context(tmp_path, every_steps=5)
    first.total_steps = 10
    assert loop(first, 10) == [5, 10]
    folder = tmp_path / "run" / step_dir(10)
    Path(stored_path(folder, "state.txt")).write_text("xx")  # same size, other bytes
    recorder = Recorder()
    again = context(tmp_path, recorder=recorder, every_steps=5)
    assert again.start_step == 5
    warnings = [args[0] for args in recorder.named("warning")]
    assert any("the corrupt checkpoint at step 10 is uncommitted" in w for w in warnings), warnings
    assert len(list(folder.glob("manifest.corrupt-*.json"))) == 1
    again.total_steps = 12
    assert loop(again, 12) == [10, 12]
    store = CheckpointStore(StorageSpec(str(tmp_path / "run")))
    assert [r.step for r in store.committed()] == [5, 10, 12]
    files, _ = store.load(store.ref(10))
    assert files == {"state.txt": b"10"}  # written again, and intact


def test_a_resume_source_gone_by_a_later_attempt_stops_it_with_the_reason(tmp_path):
    """resume=<uri> checked by the driver, then pruned or deleted before an attempt of a run
    with no checkpoint of its own: that attempt trained from step 0, silently."""
    CheckpointStore(StorageSpec(str(tmp_path / "other"))).save(10, {"state.txt": b"10"})
    spec = worker_spec(tmp_path, resume_source=tmp_path / "other" / step_dir(10))
    start = start_point(spec, 0, OneRank(), tmp_path / "work0")
    assert start.step == 10 and (start.path / "state.txt").read_bytes() == b"10"
    shutil.rmtree(tmp_path / "other")
    with pytest.raises(ResumeSourceGone) as gone:
        start_point(spec, 0, OneRank(), tmp_path / "work1")
    line = one_line(gone.value)
    assert line.startswith(f"resume={str(tmp_path / 'other' / step_dir(10))!r}: no committed")
    assert "pruned or deleted" in line and "\n" not in str(gone.value)


def test_a_preemption_notice_saves_at_that_step_and_stops_the_loop(tmp_path):
    recorder = Recorder()
    ctx = context(tmp_path, OneRank(notice_at_check=3), recorder, every_steps=1000)
    saved = loop(ctx, 10_000)
    # Checks after steps 1, 2 and then as rank 0 proposes: the third check had the notice.
    assert ctx.should_preempt() and len(saved) == 1
    notice_step = recorder.named("preemption_notice")[0][0]
    assert saved == [notice_step] and WorkerLifecycle(ctx).step == notice_step
    assert context(tmp_path).start_step == notice_step


class Replayed:
    """The collective as a rank other than 0 sees it: rank 0's broadcasts, in order."""

    def __init__(self, proposals: list):
        self.proposals = list(proposals)

    def broadcast(self, value):
        return self.proposals.pop(0) if value is None else value

    def preemption_info(self):
        return None

    agree = OneRank.agree


class Recording(OneRank):
    def __init__(self):
        super().__init__()
        self.proposals = []

    def broadcast(self, value):
        self.proposals.append(value)
        return value


def test_a_step_costs_rank_0_a_report_now_and_then_and_the_other_ranks_no_actor_call(tmp_path):
    """The control plane at 1,024 ranks (issue 65): rank 0 batches its steps' reports (about
    four a second, not one a step), and no other rank calls the recorder per step, so the
    recorder's load does not grow with the world size."""
    recorder, collective = Recorder(), Recording()
    spec = worker_spec(tmp_path, recorder, every_steps=10**6)
    start = start_point(spec, 0, collective, tmp_path / "w0")
    ranks = [WorkerContext(spec, 0, 0, 1024, [], start, collective, tmp_path / "w0")]
    steps = 2000
    for step in range(1, steps + 1):
        ranks[0].step_done(step, {"loss": 1.0 / step}, samples=4)
    reports = len(recorder.named("progress"))
    assert 1 <= reports <= 100  # batched by time: the loop above takes well under 25 s
    assert recorder.named("progress")[0][0] == 1  # the first at once, the rest batched
    before = len(recorder.calls)
    other = WorkerContext(worker_spec(tmp_path, recorder, every_steps=10**6), 513, 1, 1024, [],
                          start, Replayed(collective.proposals[1:]), tmp_path / "w513")
    for step in range(1, steps + 1):
        other.step_done(step, {"loss": 1.0 / step}, samples=4)
        other.should_save(step)
        other.should_preempt()
    assert recorder.calls[before:] == []


def test_time_based_checkpoints_are_agreed_at_a_check(tmp_path):
    ctx = context(tmp_path, every_steps=None, every_seconds=1e-6)
    saved = loop(ctx, 3)
    assert saved and saved[0] == 1  # decided by rank 0's clock at the first check


def test_batches_split_the_global_batch_and_the_position_is_kept(tmp_path):
    ctx = context(tmp_path, every_steps=2)
    batches = ctx.batches(num_rows=100, global_batch=8)
    assert len(batches.rows(0)) == 8 and batches.steps_per_epoch == 12
    loop(ctx, 2)
    manifest = __import__("json").loads((tmp_path / "run" / "step_000000002" / "manifest.json").read_text())
    assert manifest["meta"]["data"] == {"seed": 7, "num_rows": 100, "global_batch": 8,
                                        "next_step": 2, "epoch": 0, "batch_in_epoch": 2}
    recorder = Recorder()
    resumed = context(tmp_path, recorder=recorder)
    assert np.array_equal(resumed.batches(100, 8).rows(2), batches.rows(2))
    resumed.batches(100, 16)  # another global batch than the checkpoint's: said so
    assert "data order differs" in recorder.named("warning")[0][0]


@pytest.mark.parametrize("fn, message", [
    ("no_such_package.train:main", "cannot import no_such_package.train (ModuleNotFoundError"),
    ("tests.user_trainers:missing", "tests.user_trainers has no 'missing'"),
    ("tests.user_trainers:NOT_A_FUNCTION", "is not callable (a int)"),
    ("tests.user_trainers:takes_one_argument", "takes the wrong arguments (ctx): it is called as fn(ctx, cfg)"),
    ("main", "an import path such as mypkg.train:main"),
])
def test_a_training_function_that_cannot_be_called_is_refused(fn, message):
    with pytest.raises(ConfigError) as err:
        check_training({"fn": fn, "backend": "torch"})
    assert message in str(err.value) and str(err.value).startswith(f"trainer.fn={fn!r}")


@pytest.mark.parametrize("trainer, message", [
    ({"backend": "torch"}, "trainer.fn: a value is required"),
    ({"fn": "tests.user_trainers:fails_at_step_35", "backend": "mpi"}, "trainer.backend='mpi' is not allowed: one of torch"),
    ({"fn": "trainers.pytorch.train:main", "lr": -1.0}, "trainer.lr=-1.0 is not allowed: a number > 0"),
    ({"fn": "trainers.pytorch.train:main", "lr": "fast"}, "trainer.lr='fast' is not allowed: a number"),
    ({"fn": "trainers.pytorch.train:main", "colour": 1}, "trainer.colour: unknown key"),
])
def test_a_trainer_config_is_checked_against_the_schema_its_function_declares(trainer, message):
    with pytest.raises(ConfigError) as err:
        check_training(trainer)
    assert message in str(err.value)


def test_the_schemas_defaults_fill_in_and_a_plain_function_keeps_its_own_keys():
    model = {"_target_": "trainers.pytorch.models.MLP", "in_features": 64, "out_features": 10}
    digits = {"name": "digits", "task": "classification", "features": 64, "outputs": 10}
    ddp = check_training({"fn": "trainers.pytorch.train:main", "lr": 0.5, "model": model}, digits)
    assert ddp.config["lr"] == 0.5 and ddp.config["batch_size"] == 64
    assert ddp.backend.name == "torch" and ddp.info.step_unit == "step"
    own = check_training({"fn": "tests.user_trainers:fails_at_step_35", "steps": 3, "anything": [1]})
    assert own.config == {"fn": "tests.user_trainers:fails_at_step_35", "steps": 3, "anything": [1]}


def test_a_check_may_say_which_metrics_the_run_reports():
    assert check_training({"fn": "tests.user_trainers:reports_a_score"}).metrics == (
        "score", "train_score")
    assert check_training({"fn": "tests.user_trainers:fails_at_step_35"}).metrics is None
    with pytest.raises(ConfigError, match=r"^trainer.fn='tests.user_trainers:check_returns_a_"
                       r"number': its check returned a float: it may return the names of the "
                       r"metrics the run reports \(a list of str\), or None$"):
        check_training({"fn": "tests.user_trainers:check_returns_a_number"})


def test_a_final_checkpoint_that_never_commits_is_not_a_success(tmp_path):
    """The worker asks after its last upload: a lost final checkpoint is an error (the run
    must not report success over it), a committed one is not."""
    ctx = context(tmp_path)
    loop(ctx, 10)
    ctx.save(10, lambda d: (d / "state.txt").write_text("10"))
    life = WorkerLifecycle(ctx)
    life.close()
    assert life.last_checkpoint_missing() is None

    ctx = context(tmp_path)  # resumes at 10; its store refuses the next commit
    ctx._store.commit = lambda *a, **k: (_ for _ in ()).throw(OSError("SlowDown: try later"))
    ctx.save(12, lambda d: (d / "state.txt").write_text("12"))
    life = WorkerLifecycle(ctx)
    life.close()
    assert life.last_checkpoint_missing() == (
        "the checkpoint at step 12 was not committed: SlowDown: try later")


def test_a_checkpoint_no_later_one_could_commit_stops_the_run_at_once(tmp_path):
    """Two ranks writing the same file (a user's save without `if ctx.rank == 0`): each
    checkpoint was refused with a warning and the run trained to its end, then failed."""
    from orchestrator.checkpoint.store import SameFileFromTwoRanks
    from orchestrator.worker_api import CheckpointsCannotCommit

    ctx = context(tmp_path)
    ctx._store.commit = lambda *a, **k: (_ for _ in ()).throw(
        SameFileFromTwoRanks("ranks 0 and 1 both wrote 'model.pt' into the checkpoint at step 2"))
    ctx.step_done(1)
    ctx.step_done(2)
    ctx.save(2, lambda d: (d / "model.pt").write_text("2"))
    ctx._flush()
    with pytest.raises(CheckpointsCannotCommit, match=r"step 2 was not committed: ranks 0 and 1 "
                                                      r"both wrote 'model.pt'.*no checkpoint of "
                                                      r"this run can be") as err:
        ctx.step_done(3)
    assert err.value.retry is False  # a restart would meet the same refusal
    ctx._close()


def test_a_time_based_checkpoint_is_taken_whether_the_loop_asks_before_or_after_step_done(
        tmp_path):
    ctx = context(tmp_path, every_steps=None, every_seconds=1e-6)
    saved = []
    for step in range(1, 4):  # should_save first, then step_done: no checkpoint was ever taken
        if ctx.should_save(step):
            ctx.save(step, lambda d: (d / "s.txt").write_text("s"))
            saved.append(step)
        ctx.step_done(step, {"loss": 1.0})
    WorkerLifecycle(ctx).close()
    assert saved and saved[0] == 2  # agreed at step 1's check, taken at the next step asked


class RankZeroSavedAt(OneRank):
    """This rank's view of the check's broadcast when rank 0 saved at ``step`` and it did not
    (``if rank == 0: ctx.save(...)``)."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step

    def broadcast(self, value):
        return (*value[:2], self.step) if isinstance(value, tuple) else value


def test_a_save_on_rank_0_alone_stops_the_run_with_the_reason_not_a_half_hour_wait(tmp_path):
    from orchestrator.worker_api import SaveNotOnEveryRank

    ctx = context(tmp_path, collective=RankZeroSavedAt(5))
    with pytest.raises(SaveNotOnEveryRank, match=r"ctx.save\(\) was last called at step 5 on rank "
                                                 r"0 and at step 0 on rank 0: every rank calls save"):
        ctx.step_done(6, {"loss": 1.0})
    assert SaveNotOnEveryRank.retry is False


def test_metrics_are_numbers_taken_when_reported_and_a_result_keeps_its_numbers(tmp_path):
    from orchestrator.observe.step_reports import MetricNotANumber
    from orchestrator.worker.loop import final_metrics

    recorder = Recorder()
    ctx = context(tmp_path, recorder=recorder)
    metrics = {}
    for step in range(1, 4):  # one dict, updated in place: each step's own values are kept
        metrics["loss"] = 1.0 / step
        ctx.step_done(step, metrics, samples=1)
    WorkerLifecycle(ctx).close()
    points = [p for args in recorder.named("progress") for p in args[4]]
    assert [m["loss"] for _, m in points] == [1.0, 0.5, 1.0 / 3]
    with pytest.raises(MetricNotANumber, match=r"ctx.step_done\(4, metrics\): metrics\['phase'\] = "
                                               r"'warmup' is not a number"):
        ctx.step_done(4, {"phase": "warmup"})
    warned = []
    assert final_metrics({"acc": np.float32(0.5), "best": "step_200", "n": 3}, warned.append) == \
        {"acc": 0.5, "n": 3.0}
    assert warned == ["the training function's result['best'] = 'step_200' is not a number: "
                      "left out of the run's metrics"]


def test_a_users_check_that_asserts_refuses_the_config_in_one_line():
    with pytest.raises(ConfigError, match=r"^trainer.fn='tests.user_trainers:checks_with_an_assert':"
                                          r" its check refused the config: AssertionError: steps "
                                          r"must be >= 1$"):
        check_training({"fn": "tests.user_trainers:checks_with_an_assert", "steps": 0})


def test_a_write_naming_the_manifest_stops_the_run_and_an_empty_checkpoint_is_said(tmp_path):
    from orchestrator.worker_api import CheckpointsCannotCommit

    recorder = Recorder()
    ctx = context(tmp_path, recorder=recorder)
    ctx.step_done(1)
    ctx.save(1, lambda d: None)  # writes nothing: torch.save(state, "model.pt") by mistake
    ctx._flush()
    assert any("holds no data: write(dir) wrote nothing" in args[0]
               for args in recorder.named("warning"))
    ctx.step_done(2)
    ctx.save(2, lambda d: (d / "manifest.json").write_text("{}"))
    ctx._flush()
    with pytest.raises(CheckpointsCannotCommit, match=r"made 'manifest.json'.*no checkpoint of "
                                                      r"this run can be \(name it otherwise"):
        ctx.step_done(3)
    ctx._close()


def test_rank_0_paces_its_checks_by_what_the_other_nodes_waited_for_its_answer(tmp_path):
    """Rank 0 does not wait at a check (preemption_agreement.py: it hands its answer to the
    controller and goes on); what a check costs is the other nodes' wait for that answer, which
    its collective learns from the controller (``waited_s``): the schedule counts that, so a
    slow check is spaced out (test_preemption_checks.py) even though rank 0 never waited."""

    class Paced(OneRank):
        waited_s = 2.0  # the last nodes waited 2 s for rank 0's answer

    collective = Paced()
    spec = worker_spec(tmp_path, Recorder(), every_steps=10**6)
    ctx = WorkerContext(spec, 0, 0, 1024, [], start_point(spec, 0, collective, tmp_path / "w"),
                        collective, tmp_path / "w")
    ctx.step_done(1, {"loss": 1.0}, samples=4)  # the first check, right after the first step
    assert collective.checks == 1 and ctx._checks._took == 2.0
    plain = OneRank()
    ctx = WorkerContext(spec, 0, 0, 1, [], start_point(spec, 0, plain, tmp_path / "p"), plain,
                        tmp_path / "p")
    ctx.step_done(1, {"loss": 1.0}, samples=4)
    assert plain.checks == 1 and ctx._checks._took < 1.0
