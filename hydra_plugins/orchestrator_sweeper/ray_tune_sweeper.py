"""The `ray_tune` sweeper (hydra/sweeper=ray_tune, the orchestrator's default): trials of a
--multirun run as orchestrated jobs on Ray Tune, then a sweep report is written."""

from __future__ import annotations

import sys
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf

from orchestrator.sweep.config import register_sweeper

register_sweeper(ConfigStore.instance())


class RayTuneSweeper(Sweeper):
    def __init__(self, **_settings: Any):  # read typed from the config in setup()
        self.hydra_context = None
        self.config: DictConfig | None = None

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        # Trials run orchestrator.driver.launch themselves (task_function would call sys.exit).
        self.hydra_context = hydra_context
        self.config = config

    def sweep(self, arguments: list[str]) -> Any:
        from orchestrator.sweep.runner import run_sweep

        conf = OmegaConf.to_object(self.config.hydra.sweeper)
        code = run_sweep(conf, self.hydra_context, self.config, list(arguments))
        if code:
            sys.exit(code)
        return code
