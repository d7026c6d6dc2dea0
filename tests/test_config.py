"""Config composition and input checks: every option composes; bad input is one line, exit 2."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from orchestrator.cli import CONF_DIR
from orchestrator.config.preflight import check_command_line, expand_sweep, split_command_line
from orchestrator.config.rules import require_path_name
from orchestrator.config.typed import to_typed
from orchestrator.errors import ConfigError
from scripts.mlflow_server import free_port
from tests.conftest import CliBatch, run_cli
from tests.helpers import assert_input_error

GROUP_OPTIONS = {
    group: sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    for group in ("trainer", "cluster", "storage", "data", "checkpoint", "failure", "log",
                  "tracking")
}


@pytest.mark.parametrize(
    "override",
    [f"{g}={o}" for g, opts in GROUP_OPTIONS.items() for o in opts],
)
def test_every_option_composes_and_types(override):
    extra = {"data=parquet": ["data.path=/some/file.parquet"],
             "storage=s3": ["storage.uri=s3://bucket/prefix"],
             "trainer=function": ["trainer.fn=tests.user_trainers:fails_at_step_35"],
             "trainer=script": ["trainer.command='python train.py'"],
             "data=torch": ["data.train._target_=mypkg.data.Train",
                            "data.eval._target_=mypkg.data.Eval"]}.get(override, [])
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = to_typed(compose("config", overrides=[override, *extra]))
    group, option = override.split("=")
    if hasattr(getattr(cfg, group), "name"):
        assert getattr(cfg, group).name == option


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["trainer=foo"], "trainer="),
        (["cluster.workers=0"], "cluster.workers=0"),
        (["cluster.workers=-2"], "cluster.workers=-2"),
        (["cluster.workers=2", "cluster.min_workers=3"], "cluster.min_workers=3"),
        (["cluster.workers=abc"], "cluster.workers='abc'"),
        (["trainer.lr=fast"], "trainer.lr='fast'"),
        (["trainer.batch_size=1.5x"], "trainer.batch_size='1.5x'"),
        (["foo.bar=1"], "foo"),
        (["+foo=1"], "foo"),
        (["+cluster.spare=1"], "cluster.spare"),
        (["data=parquet"], "data.path"),
        (["checkpoint.every_steps=0"], "checkpoint.every_steps=0"),
        (["trainer.optimizer=lbfgs"], "trainer.optimizer='lbfgs'"),
        (["run.name=a/b"], "run.name='a/b'"),
        (["run.name=.."], "run.name='..'"),
        (["run.name=x..y"], "run.name='x..y'"),
        (["trainer.name=../../x"], "trainer.name='../../x'"),
        (["trainer=xgboost", "trainer.name=a/b"], "trainer.name='a/b'"),
        (["trainer=function", "trainer.fn=tests.user_trainers:fails_at_step_35",
          "trainer.name=/tmp/x"], "trainer.name='/tmp/x'"),
        (["log.progress=fancy"], "log.progress='fancy'"),
        (["tracking=wandb"], "tracking="),
        (["tracking=mlflow", "tracking.buffer=10"], "tracking.buffer=10"),
        (["tracking=mlflow", "tracking.flush_s=-1"], "tracking.flush_s=-1"),
        (["log.progress_every_s=0"], "log.progress_every_s=0"),
        (["log.ray_verbose=maybe"], "log.ray_verbose='maybe'"),
        (["failure.spare_after_s=-1"], "failure.spare_after_s=-1"),
        (["cluster.keep_alive=inf"], "cluster.keep_alive=inf"),  # a service could not wait so long
        (["cluster.keep_alive=1e12"], "cluster.keep_alive=1000000000000.0"),
        # a key of the user's own, without Hydra's +: the + is named
        (["trainer=xgboost", "trainer.params.eval_metric=auc"],
         "trainer.params.eval_metric: not in trainer.params yet: a key of your own there is "
         "added with a leading +: +trainer.params.eval_metric=..."),
        (["trainer.lrr=1"], "trainer.lrr: unknown key"),
        # tracebacks, exit 1, found by a review: an infinite GPU count, a group set to null
        (["cluster.gpus_per_worker=inf"], "cluster.gpus_per_worker=inf"),
        (["trainer=null"], "trainer=null is not allowed: name one of its options"),
        (["hydra.job.chdir=true"], "hydra.job.chdir=true is not allowed"),
        # Hydra's resolver in a job's key: "ValueError raised while resolving interpolation:
        # HydraConfig was not set" before
        (["trainer.name=${hydra:job.name}"], "trainer.name: ${hydra:...} is not allowed"),
        # Hydra's own keys were Hydra's error after the checks (exit 1, several lines)
        (["hydra.foo=1"], "hydra.foo: unknown key (see `python -m orchestrator --cfg hydra`"),
        (["hydra.job.name=x/y"], "hydra.job.name='x/y' is not allowed"),  # its log file's name
        (["-m", "hydra.job.name=../x", "seed=0,1"], "hydra.job.name='../x' is not allowed"),
    ],
)
def test_bad_overrides_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        check_command_line(overrides, CONF_DIR)
    message = str(err.value)
    assert key in message and "\n" not in message


@pytest.mark.parametrize("overrides", [
    ["hydra.job.name=my..job"], ["hydra.job.name=${hydra:runtime.choices.trainer}"],
    ["-m", "hydra.job.name=${hydra:runtime.choices.trainer}", "seed=0,1"],
    ["hydra.verbose=true", "hydra.run.dir=/tmp/x y"]])
def test_hydra_keys_hydra_takes_are_taken(overrides):
    check_command_line(overrides, CONF_DIR)


@pytest.mark.parametrize("flag", [[], ["--multirun"]])
def test_an_override_hydra_cannot_parse_is_named_with_the_quoting_that_fixes_it(flag):
    """A glob's brackets are Hydra's list syntax: the line names the override and shows it
    quoted, and the quoted form is accepted, as one value, not a list."""
    with pytest.raises(ConfigError) as err:
        check_command_line([*flag, "data=parquet", "data.path=data/part[01].parquet"], CONF_DIR)
    assert str(err.value) == (
        "cannot parse 'data.path=data/part[01].parquet': mismatched input '[' expecting <EOF>; "
        "a value with brackets, commas or spaces goes in quotes: "
        "'data.path=\"data/part[01].parquet\"'")
    assert expand_sweep(['data.path="data/part[01].parquet"'], multirun=bool(flag)) == [
        ['data.path="data/part[01].parquet"']]
    with pytest.raises(ConfigError, match="goes in quotes"):  # beside a key of Hydra's own
        check_command_line([*flag, "seed=[1", "hydra.verbose=true"], CONF_DIR)


@pytest.mark.parametrize("name", ["../x", "a/b", ".."])
def test_a_sweep_name_stays_one_folder(name):
    with pytest.raises(ConfigError) as err:
        check_command_line(["-m", f"hydra.sweeper.name={name}", "seed=0,1"], CONF_DIR)
    message = str(err.value)
    assert f"hydra.sweeper.name={name!r}" in message and "'..'" in message
    assert "\n" not in message


@pytest.mark.parametrize("name", ["a\\b", "a\x00b", "", " ", ".", "x/../y"])
def test_names_that_become_folders_refuse_what_leaves_one(name):
    with pytest.raises(ConfigError, match=r"trainer\.name=.*without '/'"):
        require_path_name("trainer.name", name)


@pytest.mark.parametrize("name", ["exp1", "ddp-digits-70b5aa39", "lr=0.1,seed=2", "v1.2"])
def test_plain_names_are_folder_names(name):
    require_path_name("run.name", name, nullable=True)


def test_every_trial_of_a_sweep_is_checked():
    assert check_command_line(["-m", "cluster.workers=1,2", "seed=0,1"], CONF_DIR) == 4
    with pytest.raises(ConfigError, match="cluster.workers=0"):
        check_command_line(["--multirun", "cluster.workers=2,0"], CONF_DIR)


def test_hydra_flags_are_not_taken_for_overrides():
    assert split_command_line(["--cfg", "job", "seed=3", "hydra.run.dir=x"]) == (
        ["seed=3", "hydra.run.dir=x"], False)
    assert split_command_line(["--help"]) is None
    assert expand_sweep(["a=1,2", "b=3", "hydra.run.dir=x"], multirun=True) == [
        ["b=3", "a=1"], ["b=3", "a=2"]]


def test_ray_starts_beside_the_trial_of_the_parts_only_for_a_command_that_runs_one_job():
    """The CLI's hook (orchestrator/driver/session_start.py) is called once, after the
    training function and its config passed, before the trial of the user's parts: not for
    a sweep (it starts its own session), --cfg, or input refused before the trial."""
    calls = []

    def before(cfg, typed):
        calls.append(typed.cluster.workers)

    check_command_line(["cluster.workers=3"], CONF_DIR, before_parts=before)
    assert calls == [3]
    check_command_line(["--cfg", "job", "cluster.workers=3"], CONF_DIR, before_parts=before)
    check_command_line(["-m", "cluster.workers=1,2"], CONF_DIR, before_parts=before)
    with pytest.raises(ConfigError, match="trainer.fn"):
        check_command_line(["trainer=function", "trainer.fn=mypkg.nope:main"], CONF_DIR,
                           before_parts=before)
    assert calls == [3]


def test_the_run_takes_the_session_started_for_its_settings_and_stops_any_other(monkeypatch):
    from orchestrator.driver import session_start
    from orchestrator.driver.ray_session import RaySession

    started, abandoned = [], []
    monkeypatch.setattr(RaySession, "start_in_background", lambda self: started.append(self))
    monkeypatch.setattr(RaySession, "abandon", lambda self: abandoned.append(self))
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        node = compose("config", overrides=["cluster.workers=2"])
    cfg = to_typed(node)
    session_start.start_early(node, cfg)
    env = session_start.session_env(cfg, session_start.backend_named("torch"))
    assert session_start.session_for(cfg.cluster, env, cfg.log.ray_verbose) is started[0]
    assert session_start.abandon_early() is False  # taken: nothing left to stop
    session_start.start_early(node, cfg)
    other = session_start.session_for(cfg.cluster, {**env, "X": "1"}, cfg.log.ray_verbose)
    assert other is not started[1] and abandoned == [started[1]]


def test_user_model_keys_are_free_form():
    check_command_line(["+trainer.model.dropout=0.1", "trainer.model.hidden=[32]"], CONF_DIR)


# -- the command line, end to end, for input that must stop before any worker starts -------


# A group option, a check across keys, an unknown key: the CLI's path from Hydra's composition
# to one line and exit code 2 (every key's message is checked in-process by
# test_bad_overrides_name_the_key).
BAD_CONFIG = {"group": (["trainer=tensorflowz"], "trainer="),
              "across": (["cluster.workers=2", "cluster.min_workers=4"], "cluster.min_workers"),
              "unknown": (["no_such_key=1"], "no_such_key"),
              # Nothing listens there: one line naming the key, before Ray starts.
              "tracking": (["tracking=mlflow", f"tracking.uri=http://127.0.0.1:{free_port()}"],
                           "tracking.uri=http://127.0.0.1:")}


@pytest.fixture(scope="module")
def bad_config(tmp_path_factory):
    return CliBatch(tmp_path_factory.mktemp("bad-config"),
                    {case: overrides for case, (overrides, _) in BAD_CONFIG.items()})


@pytest.mark.parametrize("case", BAD_CONFIG)
def test_cli_rejects_bad_config(bad_config, case):
    assert_input_error(bad_config.result(case), BAD_CONFIG[case][1], bad_config.storage(case))


UNCALLABLE = {"mypkg.nope:main": "cannot import mypkg.nope", "mypkg.train:steps": "has no 'steps'",
              "mypkg.bad:NOT_CALLABLE": "is not callable",
              "mypkg.bad:one_argument": "takes the wrong arguments"}


@pytest.fixture(scope="module")
def uncallable(tmp_path_factory):
    """Run from the user's own project folder, as a user would."""
    from tests.conftest import user_project

    base = tmp_path_factory.mktemp("uncallable")
    project = user_project(base)
    (project / "mypkg" / "bad.py").write_text("NOT_CALLABLE = 3\n\ndef one_argument(ctx):\n    pass\n")
    return CliBatch(base, {i: ["trainer=function", f"trainer.fn={fn}"]
                           for i, fn in enumerate(UNCALLABLE)}, cwd=project)


@pytest.mark.parametrize("i, fn", list(enumerate(UNCALLABLE)))
def test_cli_rejects_a_training_function_it_cannot_call(uncallable, i, fn):
    result = uncallable.result(i)
    assert_input_error(result, f"trainer.fn={fn!r}", uncallable.storage(i))
    assert UNCALLABLE[fn] in result.stderr


BAD_PARTS = [
    (["trainer.model._target_=mypkg.nope.Net"],
     "trainer.model._target_='mypkg.nope.Net': No module named 'mypkg.nope'"),
    (["data=torch", "data.train._target_=mypkg.bad_parts.RaggedItems",
      "data.eval._target_=mypkg.bad_parts.RaggedItems", "trainer.model.in_features=1",
      "trainer.model.out_features=2"],
     "data.collate_fn: batching two items of data.train: RuntimeError: stack expects each tensor"),
    (["trainer.model._target_=mypkg.bad_parts.FiveByTwo"],
     "trainer.loss: on the model's output and the target: "),
    (["trainer.loss._target_=mypkg.bad_parts.per_sample_loss"],
     "trainer.loss: it gave (2,); the loss must be one number"),
    (["cluster.gpus_per_worker=0.5"], "cluster.gpus_per_worker=0.5 is not allowed with nccl"),
]


@pytest.fixture(scope="module")
def bad_parts(tmp_path_factory):
    from tests.conftest import user_project

    base = tmp_path_factory.mktemp("bad-parts")
    # Ray's own folder, short (its socket paths are limited), and a mark in the environment
    # of every process the commands' embedded clusters start.
    ray_dir = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    yield CliBatch(base, {i: overrides for i, (overrides, _) in enumerate(BAD_PARTS)},
                   cwd=user_project(base), env={"RAY_TMPDIR": ray_dir})
    shutil.rmtree(ray_dir, ignore_errors=True)


def processes_with(variable: str) -> list[str]:
    """The command lines of the running processes whose environment has ``variable`` (each
    process a command started inherits its environment)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if variable.encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except OSError:
            continue
    return found


@pytest.mark.parametrize("i", range(len(BAD_PARTS)))
def test_cli_tries_the_users_parts_before_any_worker_starts(bad_parts, i):
    """One forward and backward on a tiny CPU batch, on the driver: what fails is one line
    naming the key, within seconds (the whole batch of cases, side by side, within 60). Ray
    starts beside that trial (orchestrator/driver/session_start.py): a command that fails it
    leaves no Ray process behind."""
    message = BAD_PARTS[i][1]
    result = bad_parts.result(i)
    assert_input_error(result, message.split(":")[0], bad_parts.storage(i))
    assert message in result.stderr, result.stderr
    assert bad_parts.seconds[i] < 60
    assert processes_with(f"RAY_TMPDIR={bad_parts.env['RAY_TMPDIR']}") == []


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    """Input found wrong only by looking at it (a file, a folder, an address, a table's
    columns), one case each, side by side."""
    from tests.conftest import free_port

    base = tmp_path_factory.mktemp("bad-inputs")
    empty = base / "empty"
    (empty / "step_000000010").mkdir(parents=True)  # a folder without a manifest is not a checkpoint
    write_parquet(base / "no_label.parquet", a=[1.0, 2.0], b=[0.5, 0.1], target=[0, 1])
    write_parquet(base / "colour.parquet", a=[1.0, 2.0], colour=["red", "blue"], label=[0, 1])
    write_parquet(base / "nan.parquet", a=[1.0, float("nan"), 3.0], b=[0.5, 0.1, float("inf")],
                  y=[0.1, 0.2, 0.3])
    return CliBatch(base, {
        "data.path": ["data=parquet", f"data.path={base / 'nope.parquet'}"],
        "resume": [f"resume={empty}"],
        # A function whose driver-side check counts its calls: the address is asked after
        # every check passed, and each check ran once for the command.
        "cluster.address": [f"cluster.address=127.0.0.1:{free_port()}", "trainer=function",
                            "trainer.fn=tests.user_trainers:counts_its_checks"],
        "label": ["trainer=xgboost", "data=parquet", f"data.path={base / 'no_label.parquet'}",
                  "data.label=label"],
        "colour": ["trainer=lightgbm", "data=parquet", f"data.path={base / 'colour.parquet'}"],
        "nan": ["data=parquet", f"data.path={base / 'nan.parquet'}", "data.label=y",
                "data.task=regression"],
    }, env={"CHECK_COUNT_FILE": str(base / "checks")})


def test_cli_rejects_missing_data_path(bad_inputs):
    assert_input_error(bad_inputs.result("data.path"), "data.path", bad_inputs.storage("data.path"))


def test_cli_rejects_resume_path_without_checkpoint(bad_inputs):
    assert_input_error(bad_inputs.result("resume"), "resume=", bad_inputs.storage("resume"))


def test_cli_rejects_unanswered_cluster_address(bad_inputs):
    """Nothing listens there: refused at once, not after Ray's own connection retries
    (a minute and more). Compared with a command of the same batch refused before Ray is
    asked at all (the batch's commands start side by side: their start-up is alike)."""
    assert_input_error(bad_inputs.result("cluster.address"), "cluster.address")
    bad_inputs.result("data.path")
    assert bad_inputs.seconds["cluster.address"] < bad_inputs.seconds["data.path"] + 15
    # The preflight and the launch both check the function: its check ran once.
    assert (bad_inputs.base / "checks").read_text() == "checked\n"


def test_cli_shows_composed_config(tmp_path):
    result = run_cli(tmp_path / "run", "cluster.workers=16", flags=("--cfg", "job"), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "workers: 16" in result.stdout and "fn: trainers.pytorch.train:main" in result.stdout


@pytest.mark.parametrize("trainer", ["mwms", "xgboost", "lightgbm"])
@pytest.mark.parametrize(
    "overrides, key",
    [
        (["cluster.workers=0"], "cluster.workers=0"),
        (["cluster.workers=3", "cluster.min_workers=5"], "cluster.min_workers=5"),
        (["trainer.no_such_param=1"], "trainer.no_such_param"),
        (["seed=abc"], "seed='abc'"),
    ],
)
def test_foundation_checks_hold_for_every_trainer(trainer, overrides, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(")):
        check_command_line([f"trainer={trainer}", *overrides], CONF_DIR)


@pytest.mark.parametrize(
    "overrides",
    [["trainer=xgboost", "trainer.num_boost_round=0"], ["trainer=lightgbm", "trainer.num_leaves=1"],
     ["trainer=mwms", "trainer.optimizer=adagrad"], ["trainer=xgboost", "trainer.eta=-1"]],
)
def test_trainer_params_are_checked(overrides):
    with pytest.raises(ConfigError, match=overrides[1].split("=")[0]):
        check_command_line(overrides, CONF_DIR)


@pytest.mark.parametrize("overrides, says", [
    # the default model's `hidden` beside a builder of the user's own: a TypeError on every
    # worker, then exit 1 after the restarts
    (["trainer.model._target_=tests.user_models.tiny_keras_model"],
     "takes no 'hidden'; drop trainer.model.hidden with ~"),
    (["trainer.model._target_=tests.user_models.tiny_keras_modell", "~trainer.model.hidden"],
     "defines no 'tiny_keras_modell'"),
    (["trainer.model._target_=tests"], "an import path, module.function"),
    (["trainer.momentum=1.5"], "trainer.momentum=1.5"),
    (["trainer.lr=inf"], "trainer.lr=inf"),
    (["data=torch", "data.train._target_=tests.user_models.TinyTorchNet",
      "data.eval._target_=tests.user_models.TinyTorchNet"],
     "data=torch is not allowed with trainer=mwms"),
])
def test_mwms_refuses_before_ray_what_its_workers_would_fail_on(overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        check_command_line(["trainer=mwms", *overrides], CONF_DIR)


def test_mwms_takes_a_users_builder_with_its_own_keys():
    check_command_line(["trainer=mwms", "trainer.model._target_=tests.user_models.tiny_keras_model",
                        "~trainer.model.hidden", "+trainer.model.width=8"], CONF_DIR)


@pytest.fixture(scope="module")
def unknown_objective(tmp_path_factory):
    return CliBatch(tmp_path_factory.mktemp("objective"),
                    {t: [f"trainer={t}", "trainer.objective=reg:nonsense"] for t in ("xgboost", "lightgbm")})


@pytest.mark.parametrize("trainer", ["xgboost", "lightgbm"])
def test_cli_surfaces_an_objective_the_framework_does_not_know(unknown_objective, trainer):
    result = unknown_objective.result(trainer)
    assert_input_error(result, "trainer.objective", unknown_objective.storage(trainer))
    assert "nonsense" in result.stderr  # the framework's own words about it


def write_parquet(path, **columns) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


def test_cli_rejects_a_missing_label_column(bad_inputs):
    result = bad_inputs.result("label")
    assert_input_error(result, "data.label='label'", bad_inputs.storage("label"))
    assert "target" in result.stderr  # the columns that are there


def test_cli_rejects_a_non_numeric_feature_column(bad_inputs):
    assert_input_error(bad_inputs.result("colour"), "colour", bad_inputs.storage("colour"))


def test_cli_rejects_nonfinite_values_in_the_data(bad_inputs):
    """NaN trains to NaN and would be reported as success: the driver counts them first."""
    result = bad_inputs.result("nan")
    assert_input_error(result, "data.path=", bad_inputs.storage("nan"))
    assert "2 missing, NaN or infinite values (1 in 'a', 1 in 'b')" in result.stderr
