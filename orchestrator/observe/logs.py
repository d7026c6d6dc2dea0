"""How much of Ray's own output reaches the user's terminal (log.ray_verbose).

Quiet (the default): the output of Ray's worker processes (Train controller, placement-group
cleaner, `(RayTrainWorker pid=...)` lines) is not streamed to the driver, and Ray's own loggers
in the driver say only errors. Everything is still in Ray's session logs
(/tmp/ray/session_latest/logs) and on the dashboard's Logs page. The orchestrator's own lines
come from the driver (the recorder relays what workers have to say), so they stay.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.train import LoggingConfig

RAY_LOGGERS = ("ray", "ray.train", "ray.tune", "ray.data")


def ray_level(verbose: bool) -> int:
    """Verbose is what Ray printed before this setting existed: its warnings, not its INFO."""
    return logging.WARNING if verbose else logging.ERROR


def ray_init_kwargs(verbose: bool) -> dict[str, Any]:
    return {"log_to_driver": verbose, "logging_level": ray_level(verbose)}


def quiet_ray_loggers(verbose: bool) -> None:
    """Ray's loggers in this (the driver's) process: warnings that are Ray's business, such as
    the token-authentication notice, only with log.ray_verbose (set before ray.init logs)."""
    level = ray_level(verbose)
    for name in RAY_LOGGERS:
        logging.getLogger(name).setLevel(level)


def train_logging(verbose: bool) -> LoggingConfig:
    """Ray Train's controller and worker console logs (its log files keep every level)."""
    # Imported here: the command starts Ray before it needs Ray Train (~0.5 s of imports)
    from ray.train import LoggingConfig

    return LoggingConfig(log_level="INFO" if verbose else "WARNING")
