"""Compose and check every configuration a command line asks for, before anything runs.

Hydra's own errors are several lines long and exit with code 1; here each becomes one line
that names the key and what is allowed, raised as ConfigError (exit code 2).
"""

from __future__ import annotations

import re
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from orchestrator.config.typed import first_line, to_typed
from orchestrator.errors import ConfigError

# Hydra's flags: those that end the command early, and those that take a value.
_NOTHING_TO_CHECK = {"-h", "--help", "--hydra-help", "--version", "-i", "--info",
                     "-sc", "--shell-completion"}
_OWN_CONFIG = {"-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir"}
_TAKES_VALUE = {"-c", "--cfg", "-p", "--package", "--experimental-rerun"} | _OWN_CONFIG
_TYPE_NAMES = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false",
               "String": "a string"}


def split_command_line(argv: list[str]) -> tuple[list[str], bool] | None:
    """(overrides, multirun), or None when there is nothing to check (--help, own config)."""
    overrides, multirun, i = [], False, 0
    while i < len(argv):
        arg = argv[i]
        flag = arg.split("=", 1)[0]
        if flag in _NOTHING_TO_CHECK or flag in _OWN_CONFIG:
            return None
        if arg in ("-m", "--multirun"):
            multirun = True
        elif arg in _TAKES_VALUE:
            i += 1
        elif not arg.startswith("-") and not re.match(r"^[+~]*hydra[./]", arg):
            overrides.append(arg)
        i += 1
    return overrides, multirun


def expand_sweep(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override list of every trial (a plain run is a single trial)."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as exc:
        raise ConfigError(f"cannot parse the overrides: {first_line(exc)}") from exc
    if not multirun:
        return [overrides]
    trials: list[list[str]] = [[]]
    for ov in parsed:
        key = ov.get_key_element()
        if ov.is_sweep_override() and ov.is_discrete_sweep():
            values = [f"{key}={v}" for v in ov.sweep_string_iterator()]
        elif ov.is_sweep_override():
            continue  # a continuous search space (interval): the search checks its samples
        else:
            values = [f"{key}={ov.get_value_element_as_str()}"]
        trials = [t + [v] for t in trials for v in values]
    return trials


def check_command_line(argv: list[str], conf_dir: Path) -> int:
    """Raise ConfigError for the first bad trial; return how many configs were checked."""
    split = split_command_line(argv)
    if split is None:
        return 0
    trials = expand_sweep(*split)
    with initialize_config_dir(str(conf_dir), version_base="1.3", job_name="preflight"):
        for overrides in trials:
            to_typed(compose_one(overrides))
    return len(trials)


def compose_one(overrides: list[str]):
    try:
        return compose(config_name="config", overrides=overrides)
    except MissingConfigException as exc:
        raise ConfigError(unknown_option(exc, overrides)) from exc
    except ConfigCompositionException as exc:
        raise ConfigError(composition_error(exc)) from exc
    except OverrideParseException as exc:
        raise ConfigError(f"cannot parse the overrides: {first_line(exc)}") from exc
    except OmegaConfBaseException as exc:
        raise ConfigError(composition_error(exc)) from exc


def unknown_option(exc: MissingConfigException, overrides: list[str]) -> str:
    missing = exc.missing_cfg_file or ""
    group, _, choice = missing.rpartition("/")
    options = sorted(o for o in (exc.options or []) if not o.endswith("_schema"))
    if group and options:
        return f"{group}={choice!r} is not allowed: one of {', '.join(options)}"
    return first_line(exc)


def composition_error(exc: Exception) -> str:
    cause = exc.__cause__ or exc
    key = getattr(cause, "full_key", None) or _override_key(str(exc))
    if isinstance(cause, ValidationError):
        value = getattr(cause, "value", None)
        wanted = _expected_type(str(cause))
        if wanted:
            return f"{key}={value!r} is not allowed: {wanted}"
        return f"{key}: {first_line(cause)}"
    if isinstance(cause, ConfigKeyError) or "not in struct" in str(cause) or "not in '" in str(cause):
        return f"{key}: unknown key (see `python -m orchestrator --cfg job` for the keys)"
    return f"{key}: {first_line(cause)}" if key else first_line(exc)


def _override_key(message: str) -> str | None:
    match = re.search(r"override '([^']+)'", message) or re.search(r"override ([\w.+~/]+)=", message)
    return match.group(1) if match else None


def _expected_type(message: str) -> str | None:
    match = re.search(r"could not be converted to (\w+)", message)
    if match:
        return _TYPE_NAMES.get(match.group(1), match.group(1))
    if "is not a valid bool" in message:
        return _TYPE_NAMES["Boolean"]
    if "Non optional field cannot be assigned None" in message:
        return "a value (not null)"
    return None
