"""XGBoost as a training function (trainer=xgboost): trainer.fn=trainers.xgboost.train:main.

Declared here without importing xgboost: the driver reads this function's schema for every
command, and a command refused for a wrong key must not wait for the framework's start-up.
The framework judges the parameters in the check (once the keys are right) and trains in
trainers/xgboost/loop.py, on the workers.
"""

from __future__ import annotations

from orchestrator.worker_api import WorkerContext, training_function
from trainers.xgboost.config import XGBoostConfig


def check_config(cfg: dict) -> list[str] | None:
    """The parameters, judged by XGBoost itself (trainers/xgboost/loop.py); the names of
    the metrics the run will report."""
    from trainers.xgboost.loop import check_config as check

    return check(cfg)


@training_function(config=XGBoostConfig, check=check_config, step_unit="round", streams=True)
def main(ctx: WorkerContext, cfg: dict) -> dict[str, float] | None:
    from trainers.xgboost.loop import main as loop

    return loop(ctx, cfg)
