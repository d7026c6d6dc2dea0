"""The sweep's decisions without Ray: Hydra sweep syntax to a search space and back, what the
preflight checks, the scaling arithmetic and the report."""

from __future__ import annotations

import json

import pytest

from orchestrator.cli import CONF_DIR
from orchestrator.config.preflight import check_command_line
from orchestrator.errors import ConfigError
from orchestrator.sweep.metric import RUN_FIGURES, check_metric
from orchestrator.sweep.report import add_scaling, markdown
from orchestrator.sweep.space import build_space, check_search, check_values, tune_space
from orchestrator.sweep.trial import Progress


def test_command_line_sweeps_win_over_the_search_params():
    space = build_space(["cluster.workers=1,2", "trainer.lr=0.5", "seed=3"],
                        {"trainer.lr": "tag(log, interval(0.001, 0.1))",
                         "trainer.batch_size": "choice(32, 64)", "trainer.epochs": "2"})
    assert sorted(space.fixed) == ["seed=3", "trainer.epochs=2", "trainer.lr=0.5"]
    dims = {d.key: d for d in space.dimensions}
    assert set(dims) == {"cluster.workers", "trainer.batch_size"}
    assert dims["cluster.workers"].values == ("1", "2")
    assert space.overrides({"cluster.workers": "2", "trainer.batch_size": "64"})[-2:] == [
        "trainer.batch_size=64", "cluster.workers=2"]


def test_intervals_become_distributions_and_grid_refuses_them():
    from ray import tune

    space = build_space(["trainer.lr=tag(log, interval(0.001, 0.1))",
                         "trainer.max_depth=tag(int, interval(2, 6))", "trainer.optimizer=sgd,adam"], {})
    with pytest.raises(ConfigError, match="search=grid"):
        check_search(space, "grid")
    ps = tune_space(space, "random")
    assert isinstance(ps["trainer.lr"].get_sampler(), tune.search.sample.LogUniform) or \
        ps["trainer.lr"].lower == 0.001
    assert ps["trainer.lr"].lower == 0.001 and ps["trainer.lr"].upper == 0.1
    assert ps["trainer.max_depth"].lower == 2 and ps["trainer.max_depth"].upper == 7  # inclusive
    assert ps["trainer.optimizer"].categories == ["sgd", "adam"]
    grid = tune_space(build_space(["cluster.workers=1,2,4"], {}), "grid")
    assert grid["cluster.workers"] == {"grid_search": ["1", "2", "4"]}
    dims = {d.key: d for d in space.dimensions}
    assert dims["trainer.max_depth"].override(3.0) == "trainer.max_depth=3"
    assert dims["trainer.lr"].override(0.01) == "trainer.lr=0.01"


def test_check_values_covers_every_value_and_interval_end():
    space = build_space(["cluster.workers=1,2", "trainer.lr=interval(0.01, 0.2)"], {})
    combos = check_values(space)
    assert len(combos) == 4
    assert ["cluster.workers=2", "trainer.lr=0.2"] in combos
    # Past the limit, one dimension at a time (the fixed overrides alone first).
    assert len(check_values(space, limit=3)) == 1 + 2 + 2


@pytest.mark.parametrize("argv, key", [
    (["-m", "cluster.workers=2,0"], "cluster.workers=0"),
    (["-m", "hpo=ddp_lr_workers", "cluster.workers=1,0"], "cluster.workers=0"),
    (["-m", "hpo=nope"], "hpo='nope'"),
    (["-m", "cluster.workers=1,2", "hydra.sweeper.search=bayes"], "hydra.sweeper.search"),
    (["-m", "cluster.workers=1,2", "hydra.sweeper.mode=up"], "hydra.sweeper.mode"),
    (["-m", "trainer.lr=interval(0.2, 0.1)", "hydra.sweeper.search=random"], "trainer.lr"),
    (["-m", "trainer.lr=interval(0.01, 0.1)"], "search=grid"),
    (["-m", "hpo=ddp_lr_workers", "hydra.sweeper.early_stopping.grace_period=0"],
     "hydra.sweeper.early_stopping.grace_period"),
    (["-m", "hpo=xgboost_depth_workers", "trainer.max_depth=1,-3"], "trainer.max_depth"),
    (["-m", "hpo=ddp_lr_workers", "run.eval_every_steps=null"], "run.eval_every_steps"),
])
def test_an_invalid_value_anywhere_in_a_sweep_is_one_line(argv, key):
    with pytest.raises(ConfigError) as err:
        check_command_line(argv, CONF_DIR)
    assert key in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["ddp_lr_workers", "xgboost_depth_workers", "lightgbm_leaves_workers",
                                  "mwms_lr_workers"])
def test_every_shipped_search_composes_for_every_value(name):
    assert check_command_line(["-m", f"hpo={name}"], CONF_DIR) >= 2


def test_a_metric_is_refused_only_when_the_run_said_what_it_reports():
    check_metric("test_mse", ["test_mse", "loss"], "regression")
    check_metric("loss", ["test_mse", "loss"], "regression")  # a training metric
    check_metric("samples_per_s", ["test_mse"], "regression")  # every trial's figures
    check_metric("test_accuracy", None, None)  # a function that did not say: not refused
    with pytest.raises(ConfigError, match=r"^hydra.sweeper.metric='test_accuracy' is not "
                       r"reported by this run \(data.task=regression\): it reports test_mse, "
                       r"loss, and every trial's samples_per_s, wall_s, "):
        check_metric("test_accuracy", ["test_mse", "loss"], "regression")


def test_every_trial_reports_the_run_figures():
    record = {"steps": 10, "metrics": {"test_mse": 0.5}, "train_metrics": {"loss": 0.4},
              "wall_s": 3.0, "samples_per_s": 50.0, "world_sizes": [{"size": 2}]}
    final = Progress("test_mse", 2).final(record)
    assert set(final) - {"test_mse", "loss", "final"} == set(RUN_FIGURES)


def test_a_trial_reports_every_evaluation_once_however_many_came_between_two_reads():
    """ASHA compares trials at given steps: a trial that evaluated at steps 20, 40 and 60
    between two reads of its run.json reports all three, in order (it reported the newest
    only, so a fast trial skipped the rungs a slower one was judged at)."""
    from orchestrator.driver.record import RunRecord

    run = RunRecord(run_name="r", trainer="t", config={}, checkpoint_uri="")
    progress = Progress("test_loss", 2)
    for step in (20, 40, 60):
        run.evaluated(step, {"test_loss": 1.0 / step})
    first = progress.updates(json.loads(json.dumps(run.to_dict())))
    assert [(u["step"], u["test_loss"]) for u in first] == [(s, 1.0 / s) for s in (20, 40, 60)]
    run.evaluated(80, {"test_loss": 0.0125})
    again = progress.updates(json.loads(json.dumps(run.to_dict())))
    assert [u["step"] for u in again] == [80]  # none twice
    assert progress.updates(json.loads(json.dumps(run.to_dict()))) == []
    # A training metric: the newest value, once per new step.
    loss = Progress("loss", 1)
    assert [u["step"] for u in loss.updates({"steps": 7, "train_metrics": {"loss": 0.3}})] == [7]
    assert loss.updates({"steps": 7, "train_metrics": {"loss": 0.3}}) == []


REGRESSION = ["-m", "cluster.workers=1,2", "data.task=regression"]


@pytest.mark.parametrize("sweeper", [
    ["hydra.sweeper.search=optuna"],
    ["hydra.sweeper.early_stopping.enabled=true", "run.eval_every_steps=10"],  # ASHA
])
def test_a_search_that_compares_trials_needs_a_metric_they_report(sweeper):
    with pytest.raises(ConfigError, match=r"^hydra.sweeper.metric='test_accuracy' is not "
                       r"reported by this run \(data.task=regression\): it reports test_mse, "
                       r"test_r2, test_loss, loss, and every trial's samples_per_s"):
        check_command_line([*REGRESSION, *sweeper], CONF_DIR)
    assert check_command_line([*REGRESSION, *sweeper, "hydra.sweeper.metric=test_r2"],
                              CONF_DIR) == 2


@pytest.mark.parametrize("argv", [
    REGRESSION,  # a grid over parallelism alone compares no metric
    [*REGRESSION, "hydra.sweeper.search=optuna", "hydra.sweeper.metric=samples_per_s"],
    ["-m", "cluster.workers=1,2", "hydra.sweeper.search=optuna", "trainer=function",
     "trainer.fn=tests.user_trainers:fails_at_step_35"],  # its metrics unknown: not refused
    ["-m", "cluster.workers=1,2", "hydra.sweeper.search=optuna", "trainer=function",
     "trainer.fn=tests.user_trainers:reports_a_score", "hydra.sweeper.metric=score"],
])
def test_a_sweep_whose_metric_is_reported_or_unknown_or_not_compared_passes(argv):
    assert check_command_line(argv, CONF_DIR) == 2


def test_a_functions_own_metrics_are_what_its_sweep_is_checked_against():
    with pytest.raises(ConfigError, match=r"\(data.task=classification\): it reports score, "
                       "train_score, and every trial's"):
        check_command_line(["-m", "cluster.workers=1,2", "hydra.sweeper.search=optuna",
                            "trainer=function", "trainer.fn=tests.user_trainers:reports_a_score"],
                           CONF_DIR)


def test_scaling_compares_trials_that_differ_only_in_workers():
    rows = [
        {"trial": "a", "overrides": ["cluster.workers=1", "trainer.lr=0.1"], "workers": 1,
         "samples_per_s": 100.0, "status": "succeeded", "metric": 0.9},
        {"trial": "b", "overrides": ["cluster.workers=4", "trainer.lr=0.1"], "workers": 4,
         "samples_per_s": 300.0, "status": "succeeded", "metric": 0.9},
        {"trial": "c", "overrides": ["cluster.workers=2", "trainer.lr=0.2"], "workers": 2,
         "samples_per_s": 150.0, "status": "succeeded", "metric": 0.8},
        {"trial": "d", "overrides": ["cluster.workers=8", "trainer.lr=0.1"], "workers": 8,
         "samples_per_s": None, "status": "failed", "metric": None},
        # a failed trial's partial rate was the baseline: speedup 36, efficiency 1800%
        {"trial": "e", "overrides": ["cluster.workers=1", "trainer.lr=0.3"], "workers": 1,
         "samples_per_s": 5.0, "status": "failed", "metric": None},
        {"trial": "f", "overrides": ["cluster.workers=2", "trainer.lr=0.3"], "workers": 2,
         "samples_per_s": 180.0, "status": "succeeded", "metric": 0.7},
    ]
    add_scaling(rows)
    assert rows[4]["speedup"] is None and rows[5]["speedup"] is None
    rows = rows[:4]
    assert rows[1]["speedup"] == 3.0 and rows[1]["efficiency"] == 0.75
    assert rows[2]["speedup"] is None  # its own group, the only trial with lr=0.2: nothing to compare
    assert rows[3]["speedup"] is None
    text = markdown({"name": "s", "metric": "test_accuracy", "mode": "max", "search": "grid",
                     "trials": rows, "max_concurrent": 2, "cpu_budget": 1.0, "wall_s": 10.0,
                     "best": rows[0]})
    table = [line for line in text.splitlines() if line.startswith("| ") and "trial" not in line]
    assert len(table) == 4 and "| 0.75 |" in table[2 if table[2].startswith("| b") else 1]


def test_a_folder_holding_another_sweep_is_refused_and_solo_figures_are_a_new_sweep(tmp_path):
    """Found by reading it as a user would: the report's own advice (rerun with
    hydra.sweeper.max_concurrent=1) resumed the contended sweep under a new header, and a
    hydra.sweep.dir given again with other trials resumed the old ones silently."""
    from omegaconf import OmegaConf

    from orchestrator.sweep.config import RayTuneSweeperConf
    from orchestrator.sweep.runner import IDENTITY, another_sweep_there, sweep_identity, sweep_name

    config = OmegaConf.create({"seed": 0, "trainer": {"name": "ddp"}})
    space = build_space(["cluster.workers=1,2"], {})
    shared, solo = RayTuneSweeperConf(), RayTuneSweeperConf(max_concurrent=1)
    assert sweep_name(config, space, shared) != sweep_name(config, space, solo)
    identity = sweep_identity(config, space, shared)
    assert another_sweep_there(tmp_path, identity) is None  # nothing there yet
    (tmp_path / IDENTITY).write_text(json.dumps(identity))
    assert another_sweep_there(tmp_path, identity) is None  # the same sweep: it resumes
    wider = sweep_identity(config, build_space(["cluster.workers=1,2,4"], {}), shared)
    assert another_sweep_there(tmp_path, wider) == (
        f"{tmp_path} holds another sweep (its dims differ from this command's): give another "
        "hydra.sweep.dir (or hydra.sweeper.name), or remove that folder to start this sweep there")


def test_a_trials_own_metrics_reach_the_record_and_a_nan_is_never_best(tmp_path):
    from types import SimpleNamespace

    from orchestrator.sweep.config import RayTuneSweeperConf
    from orchestrator.sweep.report import write_report
    from orchestrator.sweep.runner import summarize, trial_row

    space = build_space(["trainer.lr=0.1,1e9"], {})
    results = [SimpleNamespace(metrics={"score": s, "test_accuracy": a, "final": True,
                                        "samples_per_s": 10.0, "time_total_s": 3.0, "step": 5},
                               config={"trainer.lr": lr}, error=None,
                               path=str(tmp_path / "tune" / f"t{i}"))
               for i, (lr, s, a) in enumerate([("1e9", float("nan"), float("nan")),
                                               ("0.1", 0.5, 0.9)])]
    rows = [trial_row(r, space, 2) for r in results]
    assert rows[1]["metrics"] == {"score": 0.5, "test_accuracy": 0.9}  # not only test_*
    summary = summarize(RayTuneSweeperConf(metric="score"), "s", tmp_path, space, rows, 2, 1.0, 0.0)
    assert summary["best"]["trial"] == "t1"  # the NaN trial came first
    written = json.loads((write_report(summary, tmp_path)["json"]).read_text())
    assert written["trials"][0]["metric"] is None  # strict JSON: null, not NaN


def test_trials_on_gpus_run_no_more_at_once_than_the_gpus_hold():
    """A trial left waiting for a GPU would fail at cluster.placement_timeout_s."""
    from orchestrator.config.schema import ClusterConfig
    from orchestrator.sweep.config import RayTuneSweeperConf
    from orchestrator.sweep.runner import concurrency, most_gpus_a_trial_asks

    conf = RayTuneSweeperConf()
    space = build_space(["cluster.workers=1,2", "cluster.gpus_per_worker=1", "trainer.lr=0.1,0.2"],
                        {})
    need = most_gpus_a_trial_asks(ClusterConfig(), space)
    assert need == 2.0  # the 2-worker trials, one GPU each
    assert concurrency(conf, 16, 4, total_gpus=4, gpus_a_trial=need) == 2
    assert concurrency(conf, 16, 4, total_gpus=1, gpus_a_trial=need) == 1  # one at a time
    assert concurrency(conf, 16, 4) == 4  # CPU trials: as before
    cpu_only = build_space(["cluster.workers=1,2,4"], {})
    assert most_gpus_a_trial_asks(ClusterConfig(), cpu_only) == 0.0
    assert most_gpus_a_trial_asks(ClusterConfig(gpus_per_worker=1), cpu_only) == 4.0


def test_after_ctrl_c_a_trial_that_had_failed_on_its_own_still_shows_failed(tmp_path):
    from types import SimpleNamespace

    from orchestrator.sweep.runner import trial_row

    space = build_space(["trainer.lr=0.1,0.2,0.3,0.4,0.5"], {})
    runs = {"t0": {"status": "succeeded"}, "t1": {"status": "failed", "error": "boom at step 3"},
            "t2": {"status": "interrupted"},
            # Its run ended and printed "succeeded"; the Ctrl-C came before Tune's final report.
            "t3": {"status": "succeeded", "steps": 40, "metrics": {"test_loss": 0.25},
                   "samples_per_s": 900.0},
            "t4": None}  # waiting for room: never started
    results = []
    for i, (trial, run) in enumerate(runs.items()):
        (tmp_path / trial).mkdir()
        if run is not None:
            (tmp_path / trial / "run.json").write_text(json.dumps(run))
        results.append(SimpleNamespace(
            metrics={"final": True} if i == 0 else {} if run is None else {"step": 3},
            config={"trainer.lr": f"0.{i + 1}"},
            error=None if i == 0 else RuntimeError("trial stopped"),
            path=str(tmp_path / "tune" / trial)))
    rows = [trial_row(r, space, 2, interrupted=True) for r in results]
    assert [r["status"] for r in rows] == ["succeeded", "failed", "interrupted", "succeeded",
                                           "not started"]
    assert rows[1]["error"] == "trial stopped" and rows[2]["error"] is None
    assert rows[3]["metrics"]["test_loss"] == 0.25 and rows[3]["steps"] == 40
    assert rows[3]["samples_per_s"] == 900.0


def test_a_sweep_may_compare_trials_by_a_figure_every_trial_reports(tmp_path):
    """hydra.sweeper.metric=samples_per_s (documented) gave no metric and no best trial: the
    figure is a row's own, not one of its metrics."""
    from types import SimpleNamespace

    from orchestrator.sweep.runner import summarize

    rows = [{"trial": t, "status": "succeeded", "metrics": {"test_accuracy": 0.9},
             "samples_per_s": rate, "wall_s": 10.0, "steps": 100} for t, rate in (("a", 1000.0),
                                                                                   ("b", 1900.0))]
    conf = SimpleNamespace(metric="samples_per_s", mode="max", search="grid")
    summary = summarize(conf, "s", tmp_path, SimpleNamespace(fixed=[]), rows, 1, 1.0, 0.0)
    assert [r["metric"] for r in rows] == [1000.0, 1900.0] and summary["best"]["trial"] == "b"


@pytest.mark.parametrize("arguments, cluster, forks", [
    (["trainer.lr=0.1,0.2"], {}, True),
    (["cluster.workers=1,2"], {}, True),
    (["trainer.lr=0.1,0.2"], {"address": "127.0.0.1:6379"}, False),  # a cluster of the user's
    (["cluster.gpus_per_worker=0,1"], {}, False),  # a GPU trial: no framework before placement
    (["trainer=ddp,mwms"], {}, False),  # another trainer's workers would start beside torch
    (["trainer.backend=torch,gloo"], {}, False),
])
def test_a_sweep_forks_its_processes_only_where_one_server_serves_them_all(
        monkeypatch, arguments, cluster, forks):
    from orchestrator.config.schema import ClusterConfig
    from orchestrator.ray_internals import fork_server
    from orchestrator.sweep import runner

    monkeypatch.setattr(runner, "ray_is_initialized", lambda: False)
    monkeypatch.setattr(fork_server, "usable", lambda: True)
    space = build_space(arguments, {})
    assert runner.forks(ClusterConfig(**cluster), space) is forks
    monkeypatch.setattr(runner, "ray_is_initialized", lambda: True)  # a service's Ray
    assert runner.forks(ClusterConfig(**cluster), space) is False


def test_the_fork_server_steps_aside_for_whatever_else_decides_how_processes_start(monkeypatch):
    from orchestrator.ray_internals import fork_server
    from orchestrator.ray_internals.knobs import SETUP_HOOK

    for name in ("RAY_RUNTIME_ENV_HOOK", SETUP_HOOK,
                 "RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper"):
        monkeypatch.delenv(name, raising=False)
    assert fork_server.usable()  # this test's process runs under no `uv run`
    for name, value in (("RAY_RUNTIME_ENV_HOOK", "mine:hook"), (SETUP_HOOK, "mine:setup"),
                        ("RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper", "1")):
        monkeypatch.setenv(name, value)
        assert not fork_server.usable(), name
        monkeypatch.delenv(name)


def test_tunes_restore_advice_is_not_shown_after_a_ctrl_c():
    """Tune's 'Resume experiment with: Tuner.restore(...)' is not how a sweep goes on (the same
    command runs the rest): the sweep's filter drops it from the logger Tune writes it to.
    (Tune's module is read, not imported: its import in pytest's process is not this test's.)"""
    import logging
    from pathlib import Path

    import ray

    from orchestrator.sweep.runner import TUNE_LOGGER, NoTunerRestoreAdvice

    source = (Path(ray.__file__).parent / "tune" / "tune.py").read_text()
    assert TUNE_LOGGER == "ray.tune.tune" and "logging.getLogger(__name__)" in source
    assert "Resume experiment with: {restore_entrypoint}" in source

    class Kept(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    logger = logging.getLogger(TUNE_LOGGER)
    kept, advice = Kept(), NoTunerRestoreAdvice()
    level = logger.level  # an earlier test's command may have quieted Ray's loggers
    logger.setLevel(logging.WARNING)
    logger.addHandler(kept)
    logger.addFilter(advice)
    try:
        logger.warning("Experiment has been interrupted, but the most recent state was saved."
                       "\nResume experiment with: Tuner.restore(path=x)")
        logger.warning("a trial failed")
    finally:
        logger.removeFilter(advice)
        logger.removeHandler(kept)
        logger.setLevel(level)
    assert kept.messages == ["a trial failed"]


def test_a_trial_the_scheduler_stopped_is_stopped_early_though_its_run_says_failed(tmp_path):
    """ASHA stops a trial: Tune removes its placement group while the trial's actor winds
    down, its run's controller dies under it and its run.json says failed; the sweep counted
    it failed and exited 1 (seen in `--multirun hpo=ddp_lr_workers`: '1 failed, 3 stopped
    early'). A trial that raised (its run failed on its own) stays failed."""
    from types import SimpleNamespace

    from orchestrator.sweep.runner import trial_row

    space = build_space(["trainer.lr=0.1,0.2"], {})
    rows = []
    cases = (("stopped", None, "failed"), ("said", RuntimeError("x"), "stopped"),
             ("failed", RuntimeError("trial failed: boom"), "failed"))
    for trial, error, status in cases:
        (tmp_path / trial).mkdir()
        (tmp_path / trial / "run.json").write_text(json.dumps(
            {"status": status, "error": "Ray Train's controller ended: ... placement group "
                                        "was removed"}))
        rows.append(trial_row(SimpleNamespace(metrics={"step": 40}, config={}, error=error,
                                              path=str(tmp_path / "tune" / trial)), space, 2))
    assert [r["status"] for r in rows] == ["stopped early", "stopped early", "failed"]
    assert rows[0]["error"] is None and rows[2]["error"] == "trial failed: boom"
