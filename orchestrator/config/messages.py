"""Hydra's and OmegaConf's errors as the one line a user reads: the key, the value, and what
is allowed. Used by the command line's checks (preflight.py) and by a training function's
own schema (training_function.py)."""

from __future__ import annotations

import re

from omegaconf.errors import ConfigKeyError, ValidationError

from orchestrator.errors import ConfigError, one_line

# Nodes whose keys are the user's (a library's parameters, a _target_'s keyword arguments):
# a key not there yet needs Hydra's +, which "unknown key" alone never said.
OPEN_NODES = {"params", "model", "loss", "step_fn", "optimizer", "scheduler", "train", "eval",
              "collate_fn", "resources"}

_TYPE_NAMES = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false",
               "String": "a string"}


def composition_error(exc: Exception, prefix: str = "") -> str:
    """One line for an OmegaConf/Hydra error; ``prefix`` names the node the keys are under
    (``trainer.`` when a trainer's keys are checked against its own schema)."""
    cause = exc.__cause__ or exc
    key = getattr(cause, "full_key", None) or getattr(exc, "full_key", None) or _override_key(str(exc))
    key = f"{prefix}{key}" if key else key
    if isinstance(cause, ValidationError):
        value = getattr(cause, "value", None)
        wanted = _expected_type(str(cause))
        if wanted:
            return f"{key}={value!r} is not allowed: {wanted}"
        return f"{key}: {one_line(cause)}"
    if isinstance(cause, ConfigKeyError) or "not in struct" in str(cause) or "not in '" in str(cause):
        parent = (key or "").rpartition(".")[0]
        if parent.rpartition(".")[2] in OPEN_NODES:  # keys of the user's choosing: Hydra's +
            return (f"{key}: not in {parent} yet: a key of your own there is added with a "
                    f"leading +: +{key}=...")
        shown = "hydra" if (key or "").startswith("hydra.") else "job"
        return f"{key}: unknown key (see `python -m orchestrator --cfg {shown}` for the keys)"
    return f"{key}: {one_line(cause)}" if key else one_line(exc)


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
    if re.search(r"Cannot assign \w+ to Dict", message):
        return "a config node: set its keys (<key>._target_=..., <key>.lr=...)"
    return None


def as_config_error(exc: Exception, prefix: str = "") -> ConfigError:
    """The ConfigError to raise for an OmegaConf error: a check of ours that OmegaConf wrapped
    (a dataclass's __post_init__) comes out as it was, anything else as composition_error's
    line."""
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, ConfigError):
        return cause
    return ConfigError(composition_error(exc, prefix))
