"""From Hydra's composed DictConfig to the typed dataclasses, with one-line errors."""

from __future__ import annotations

from dataclasses import fields, is_dataclass

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from orchestrator.config.schema import Config
from orchestrator.errors import ConfigError, one_line


def to_typed(cfg: DictConfig) -> Config:
    """Build the dataclasses (running their __post_init__ checks)."""
    reject_unknown_keys(cfg)
    try:
        return OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except MissingMandatoryValue as exc:
        raise ConfigError(f"{exc.full_key}: a value is required (set {exc.full_key}=...)") from exc
    except OmegaConfBaseException as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        key = getattr(exc, "full_key", None) or "config"
        if "HydraConfig was not set" in str(exc):  # Hydra's own resolver, outside its job
            raise ConfigError(f"{key}: ${{hydra:...}} is not allowed (the checks and the "
                              "workers run outside Hydra's job): give a value, another key "
                              "(${data.path}) or ${oc.env:NAME}") from exc
        raise ConfigError(f"{key}: {one_line(exc)}") from exc


def reject_unknown_keys(node: DictConfig, prefix: str = "") -> None:
    """Hydra's `+key=value` slips keys past a structured config; name the first one."""
    schema = OmegaConf.get_type(node)
    known = {f.name for f in fields(schema)} if is_dataclass(schema) else None
    for key in node.keys():
        full = f"{prefix}{key}"
        if known is not None and key not in known:
            raise ConfigError(f"{full}: unknown key (see `python -m orchestrator --cfg job` "
                              "for the keys)")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            reject_unknown_keys(child, f"{full}.")
