"""``trainer.fn``: find the training function and check what it will be given, on the driver,
before Ray starts. Every problem is one ConfigError line naming the key (exit 2)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, is_dataclass
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from orchestrator.config.messages import as_config_error
from orchestrator.config.once import decided_once, parts_tried
from orchestrator.config.rules import require_path_name
from orchestrator.driver.backends import Backend, backend_named
from orchestrator.driver.interrupts import interrupt_after
from orchestrator.errors import ConfigError, one_line
from orchestrator.worker_api import TrainingInfo, training_info


@dataclass(frozen=True)
class Training:
    path: str  # trainer.fn as given
    fn: Callable
    info: TrainingInfo
    backend: Backend
    config: dict  # cfg["trainer"], checked, with the schema's defaults filled in
    metrics: tuple[str, ...] | None = None  # what the run reports, as its check said (None: unknown)

    @property
    def warm_imports(self) -> tuple[str, ...]:
        """What each CPU worker's process imports as it starts: the function's, else its
        backend's (orchestrator/worker/warm.py)."""
        own = self.info.warm_imports
        return own if own is not None else self.backend.warm_imports


def import_function(path: str) -> Callable:
    """``module:function`` (or ``module.function``) -> the function."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"trainer.fn={path!r} is not allowed: an import path such as "
                          "mypkg.train:main")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any error while importing the user's module is input
        raise ConfigError(f"trainer.fn={path!r}: cannot import {module_name} "
                          f"({type(exc).__name__}: {one_line(exc)[:200]})") from exc
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ConfigError(f"trainer.fn={path!r}: {module_name} has no {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ConfigError(f"trainer.fn={path!r} is not callable (a {type(fn).__name__}): it must "
                          "be a function fn(ctx, cfg)")
    return fn


def check_signature(fn: Callable, path: str) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # no signature to read (a builtin): it will tell at the call
    try:
        signature.bind(object(), {})
    except TypeError:
        raise ConfigError(f"trainer.fn={path!r} takes the wrong arguments {signature}: it is "
                          "called as fn(ctx, cfg)") from None


def check_training(trainer: Mapping[str, Any], data: Mapping[str, Any] | None = None,
                   before_trial: Callable[[], None] | None = None) -> Training:
    """The function, its backend, and its config checked against the schema it declares, then
    by its own check (which sees what the function will: {"trainer": ..., "data": ...}).
    Once per command: the preflight's answer is the launch's (orchestrator/config/once.py).
    ``before_trial()``: called once the function and its config passed, before its own check
    (a trial of the user's parts, the costly part: the CLI starts Ray beside it)."""
    return decided_once("training", [dict(trainer), dict(data or {})],
                        lambda: _check_training(trainer, data, before_trial))


def _check_training(trainer: Mapping[str, Any], data: Mapping[str, Any] | None,
                    before_trial: Callable[[], None] | None = None) -> Training:
    path = trainer.get("fn")
    if not isinstance(path, str) or not path.strip():
        raise ConfigError("trainer.fn: a value is required: the import path of your training "
                          "function, e.g. trainer.fn=mypkg.train:main")
    if "name" in trainer:  # names the run's folder (run.name derived from it) and a sweep's
        require_path_name("trainer.name", trainer["name"])
    backend = backend_named(str(trainer.get("backend", "torch")))
    fn = import_function(path)
    check_signature(fn, path)
    info = training_info(fn)
    with users_checks(path, "schema"):
        config = validated(dict(trainer), info.config)
    if before_trial is not None:
        before_trial()
    metrics = None
    if info.check is not None and not parts_tried():  # once per command (config/once.py)
        with users_checks(path, "check"), interrupt_after():  # it imports the framework
            checked = info.check({"trainer": config, "data": dict(data or {})})
        metrics = declared_metrics(checked, path)
    return Training(path, fn, info, backend, config, metrics)


@contextmanager
def users_checks(path: str, what: str):
    """A user's own schema (its __post_init__) or check that raises ValueError, an assert...
    refuses the config (exit 2, one line), as a ConfigError would. The orchestrator's own
    trainers raise ConfigError where the input is wrong; anything else from them is a bug."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as exc:
        if path.startswith("trainers."):
            raise
        raise ConfigError(f"trainer.fn={path!r}: its {what} refused the config: "
                          f"{type(exc).__name__}: {one_line(exc)}") from None


def declared_metrics(names: Iterable[str] | None, path: str) -> tuple[str, ...] | None:
    """What a check returned: the names of the metrics the run will report, or None."""
    if names is None:
        return None
    listed = list(names) if isinstance(names, Iterable) and not isinstance(names, str) else None
    if listed is None or not all(isinstance(n, str) for n in listed):
        raise ConfigError(f"trainer.fn={path!r}: its check returned a {type(names).__name__}: it "
                          "may return the names of the metrics the run reports (a list of "
                          "str), or None")
    return tuple(listed)


def validated(trainer: dict, schema: type | None) -> dict:
    """Set the given keys on the schema (types, unknown keys; defaults for the keys not
    given), build it (its __post_init__ checks across fields), and return it as a plain dict.
    Set, not merged: a node the user gave (trainer.model) is theirs as given, a key they
    deleted (~trainer.model.hidden) does not come back from the schema's default."""
    if schema is None:
        return trainer
    try:
        merged = OmegaConf.structured(schema)
        for key, value in trainer.items():
            node = merged._get_node(key) if key in merged else None
            if node is not None and is_dataclass(OmegaConf.get_type(node)):
                merged[key] = OmegaConf.merge(node, value)  # a typed section: its defaults stay
            else:
                merged[key] = value
        OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as exc:
        raise as_config_error(exc, prefix="trainer.") from None
    return OmegaConf.to_container(merged, resolve=True)


def size_cluster(cfg_node, given: set[str]) -> None:
    """A training function that knows the run's size from its own keys (trainer=script reads
    torchrun's --nnodes and --nproc-per-node) sets cluster.* here, before the config is typed;
    a contradiction with a cluster key given on the command line is its ConfigError."""
    trainer = cfg_node.get("trainer")
    path = trainer.get("fn") if trainer is not None else None
    if not isinstance(path, str) or not path.strip() or path == "???":
        return
    info = training_info(import_function(path))
    if info.cluster is None:
        return
    try:
        trainer_keys = OmegaConf.to_container(trainer, resolve=True)
        cluster_keys = OmegaConf.to_container(cfg_node.cluster, resolve=True)
    except OmegaConfBaseException:
        return  # typing the config says what is wrong, in its own words
    for key, value in info.cluster(trainer_keys, cluster_keys, given).items():
        cfg_node.cluster[key] = value


def cluster_keys_given(overrides: list[str] | None = None) -> set[str]:
    """The cluster.* keys the command line set (Hydra's overrides), e.g. {"workers"}."""
    if overrides is None:
        try:
            from hydra.core.hydra_config import HydraConfig

            overrides = list(HydraConfig.get().overrides.task)
        except Exception:  # not under Hydra (a sweep's trial, a test): nothing given
            return set()
    keys = set()
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key.startswith("cluster."):
            keys.add(key[len("cluster."):])
    return keys
