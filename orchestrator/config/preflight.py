"""Compose and check every configuration a command line asks for, before anything runs.

Hydra's own errors are several lines long and exit with code 1; here each becomes one line
that names the key and what is allowed, raised as ConfigError (exit code 2).
"""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf.errors import OmegaConfBaseException

from orchestrator.config.messages import as_config_error, composition_error
from orchestrator.config.paths import resolve_paths
from orchestrator.config.typed import to_typed
from orchestrator.errors import ConfigError, one_line
from orchestrator.tracking.for_run import checked_tracking

if TYPE_CHECKING:
    from orchestrator.worker.training_function import Training

# Hydra's flags: those that end the command early, and those that take a value.
_NOTHING_TO_CHECK = {"-h", "--help", "--hydra-help", "--version", "-i", "--info",
                     "-sc", "--shell-completion"}
_OWN_CONFIG = {"-cp", "--config-path", "-cn", "--config-name"}
_CONFIG_DIR = {"-cd", "--config-dir"}  # a project's own config folder, searched as well
_TAKES_VALUE = {"-c", "--cfg", "-p", "--package", "--experimental-rerun"} | _OWN_CONFIG


def split_command_line(argv: list[str]) -> tuple[list[str], bool] | None:
    """(overrides, multirun), or None when there is nothing to check (--help, own primary
    config). Overrides of Hydra's own keys (hydra.sweeper.search=...) are among them; a
    --config-dir becomes the hydra.searchpath override it amounts to."""
    overrides, multirun, i = [], False, 0
    while i < len(argv):
        arg = argv[i]
        flag = arg.split("=", 1)[0]
        if flag in _NOTHING_TO_CHECK or flag in _OWN_CONFIG:
            return None
        if flag in _CONFIG_DIR:
            folder = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            overrides.append(f"hydra.searchpath=[file://{Path(folder).resolve()}]")
            i += 1 if "=" in arg else 2
            continue
        if arg in ("-m", "--multirun"):
            multirun = True
        elif arg in _TAKES_VALUE:
            i += 1
        elif not arg.startswith("-"):
            overrides.append(arg)
        i += 1
    return overrides, multirun


# Hydra's keys that take any folder: nothing to check by composing (the tests' commands set them)
HYDRA_PATH_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.searchpath")


def check_job_name(overrides: list[str]) -> None:
    """hydra.job.name names the run's log file (<name>.log in its output folder): one file
    name. A value with an interpolation is left to Hydra (it resolves it at the run)."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        value = value.strip().strip("'\"")
        if key == "hydra.job.name" and "${" not in value:
            ok = (value not in ("", ".", "..") and not any(c in value for c in "/\\")
                  and all(ord(c) >= 32 and c != "\x7f" for c in value))
            if not ok:
                raise ConfigError(f"hydra.job.name={value!r} is not allowed: a file name (the "
                                  "run's log file), without '/', '\\' or control characters")


def is_hydra_override(line: str) -> bool:
    return re.match(r"^[+~]*hydra[./]", line) is not None


def expand_sweep(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override list of every trial of a command-line sweep (a plain run is one trial)."""
    from orchestrator.sweep.space import build_space, check_values, parse

    overrides = [o for o in overrides if not is_hydra_override(o)]
    if not multirun:
        for line in overrides:
            parse(line)  # the first one Hydra's grammar refuses, named
        return [overrides]
    return check_values(build_space(overrides, {}))


def check_command_line(argv: list[str], conf_dir: Path, before_parts=None) -> int:
    """Raise ConfigError for the first bad trial; return how many configs were checked.
    ``before_parts(cfg, typed)``: called for a command that runs one job, once its config and
    its training function passed their checks, before the costly trial of the user's parts
    (the CLI starts Ray then)."""
    split = split_command_line(argv)
    if split is None:
        return 0
    overrides, multirun = split
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        if key == "hydra.job.chdir" and value.strip().lower() == "true":
            # The run would resolve data.path, storage.uri... against Hydra's output folder:
            # a rerun would never find its checkpoints.
            raise ConfigError("hydra.job.chdir=true is not allowed: paths are read from the "
                              "folder you run the command in, and the run's files go to its "
                              "output folder already")
    from orchestrator.sweep.metric import check_metric
    from orchestrator.worker.training_function import cluster_keys_given, size_cluster

    searchpath = [o for o in overrides if o.startswith("hydra.searchpath=")]
    with initialize_config_dir(str(conf_dir), version_base="1.3", job_name="preflight"):
        trials, metric = sweep_trials(overrides) if multirun else \
            (expand_sweep(overrides, False), None)
        if not multirun and any(is_hydra_override(o) and o.lstrip("+~").split("=", 1)[0]
                                not in HYDRA_PATH_KEYS for o in overrides):
            # Hydra's own keys (a sweep's are checked with its search): a wrong one was
            # Hydra's error after the checks, exit 1
            compose_one(overrides, return_hydra_config=True)
        check_job_name(overrides)
        checked: dict[str, Training] = {}
        for trial in trials:
            cfg = compose_one(trial + searchpath)
            size_cluster(cfg, cluster_keys_given(trial))
            to_typed(cfg)  # its errors name the values as the user gave them
            resolve_paths(cfg, Path.cwd())  # as launch will: its checks are these (once.py)
            typed = to_typed(cfg)
            checked_tracking(typed)  # the server answers: before Ray, before any part is tried
            starts = partial(before_parts, cfg, typed) if before_parts is not None and \
                not multirun and runs_a_job(argv) else None
            training = check_trainer(cfg, typed, checked, starts)
            if metric is not None:  # every trial must report it: the search compares them
                check_metric(metric, training.metrics, typed.data.task)
    return len(trials)


def runs_a_job(argv: list[str]) -> bool:
    """Not a command that only shows its config (--cfg) or reruns a pickled one."""
    return not any(a.split("=", 1)[0] in ("-c", "--cfg", "--experimental-rerun") for a in argv)


def check_trainer(cfg, typed, checked: dict[str, Training], before_trial=None) -> Training:
    """The training function's checks (its schema; its framework judges its parameters; a
    trial of the user's parts), once per distinct trainer and data config, so that no trial
    of a sweep fails on input after others started."""
    import json

    from omegaconf import OmegaConf

    from orchestrator.driver.backends import check_cluster
    from orchestrator.driver.run_plan import complete_data
    from orchestrator.worker.training_function import check_training

    complete_data(cfg, typed)
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    key = json.dumps([trainer, data, typed.cluster.gpus_per_worker], sort_keys=True, default=str)
    if key not in checked:
        checked[key] = check_training(trainer, data, before_trial)
        check_cluster(checked[key].backend, typed.cluster.gpus_per_worker)
    return checked[key]


def sweep_trials(overrides: list[str]) -> tuple[list[list[str]], str | None]:
    """Every configuration a --multirun may compose: the command line's sweeps and the
    selected search's `hydra.sweeper.params` (an `hpo=<name>` config), with the sweeper's own
    settings checked on the way; and the metric every trial must report (None: the search
    compares none)."""
    from omegaconf import OmegaConf

    from orchestrator.sweep.config import SWEEPER_TARGET, RayTuneSweeperConf
    from orchestrator.sweep.metric import needs_metric
    from orchestrator.sweep.space import build_space, check_search, check_values, parse

    task = [o for o in overrides if not is_hydra_override(o)]
    plain = [o for o in task if not parse(o).is_sweep_override()]
    hydra_overrides = [o for o in overrides if is_hydra_override(o)]
    base = compose_one(plain + hydra_overrides, return_hydra_config=True)
    sweeper = base.hydra.sweeper
    if sweeper.get("_target_") != SWEEPER_TARGET:
        return expand_sweep(task, True), None  # another sweeper (hydra/sweeper=basic): its own rules
    try:
        conf: RayTuneSweeperConf = OmegaConf.to_object(sweeper)
    except ConfigError:
        raise
    except OmegaConfBaseException as exc:
        raise as_config_error(exc) from None
    space = build_space(task, dict(conf.params))
    check_search(space, conf.search)
    if conf.early_stopping.enabled and conf.metric.startswith("test_") and \
            base.run.eval_every_steps is None:
        raise ConfigError(
            "hydra.sweeper.early_stopping.enabled=true needs run.eval_every_steps (trials "
            f"report {conf.metric} only at the end otherwise): set run.eval_every_steps=N")
    return check_values(space), conf.metric if needs_metric(conf) else None


def compose_one(overrides: list[str], return_hydra_config: bool = False):
    try:
        return compose(config_name="config", overrides=overrides,
                       return_hydra_config=return_hydra_config)
    except MissingConfigException as exc:
        raise ConfigError(unknown_option(exc, overrides)) from exc
    except ConfigCompositionException as exc:
        raise ConfigError(composition_error(exc)) from exc
    except OverrideParseException as exc:
        raise ConfigError(f"cannot parse the overrides: {one_line(exc)}") from exc
    except OmegaConfBaseException as exc:
        raise ConfigError(composition_error(exc)) from exc
    except ConfigError:
        raise
    except ValueError as exc:  # trainer=null: "Config group override must be a string..."
        if "Config group override" not in str(exc):
            raise
        group = next((o.split("=", 1)[0] for o in overrides
                      if "." not in o.split("=", 1)[0] and o.split("=", 1)[-1] in ("null", "~")),
                     None)
        raise ConfigError(f"{group}=null is not allowed: name one of its options"
                          if group else one_line(exc)) from exc


def unknown_option(exc: MissingConfigException, overrides: list[str]) -> str:
    missing = exc.missing_cfg_file or ""
    group, _, choice = missing.rpartition("/")
    options = sorted(o for o in (exc.options or []) if not o.endswith("_schema"))
    if group and options:
        return f"{group}={choice!r} is not allowed: one of {', '.join(options)}"
    return one_line(exc)
