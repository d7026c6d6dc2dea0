"""LightGBM as a training function (trainer=lightgbm): trainer.fn=trainers.lightgbm.train:main.

Declared here without importing lightgbm: the driver reads this function's schema for every
command, and a command refused for a wrong key must not wait for the framework's start-up.
The framework judges the parameters in the check (once the keys are right) and trains in
trainers/lightgbm/loop.py, on the workers.
"""

from __future__ import annotations

from orchestrator.worker_api import WorkerContext, training_function
from trainers.lightgbm.config import LightGBMConfig


def check_config(cfg: dict) -> list[str] | None:
    """The parameters, judged by LightGBM itself (trainers/lightgbm/loop.py); the names of
    the metrics the run will report."""
    from trainers.lightgbm.loop import check_config as check

    return check(cfg)


@training_function(config=LightGBMConfig, check=check_config, step_unit="round", streams=True)
def main(ctx: WorkerContext, cfg: dict) -> dict[str, float] | None:
    from trainers.lightgbm.loop import main as loop

    return loop(ctx, cfg)
