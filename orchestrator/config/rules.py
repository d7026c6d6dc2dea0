"""The two rules every config check is written with: one line naming the key, the value and
what is allowed (ConfigError, exit 2). A module of their own: the schema, the sweeper's
config and every trainer's config use them, and none of those must import the others."""

from __future__ import annotations

from typing import Any

from orchestrator.errors import ConfigError


def require(condition: bool, key: str, value: Any, allowed: str) -> None:
    if not condition:
        raise ConfigError(f"{key}={value!r} is not allowed: {allowed}")


PATH_NAME = "a non-empty name without '/', '\\', '..' or control characters"


def require_path_name(key: str, value: Any, nullable: bool = False) -> None:
    """A user-given name that becomes a folder name (run.name, trainer.name,
    hydra.sweeper.name) stays one folder: ``a/b`` or ``../x`` would write elsewhere."""
    ok = (isinstance(value, str) and value.strip() != "" and value not in (".", "..")
          and not any(part in value for part in ("/", "\\", ".."))
          and all(ord(c) >= 32 and c != "\x7f" for c in value))
    require(ok, key, value, ("null or " if nullable else "") + PATH_NAME)
