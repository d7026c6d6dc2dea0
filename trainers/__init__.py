"""Trainers: one per framework, each behind orchestrator.trainer_api.Trainer.

This package's top level imports no framework: the driver reads the schemas below without
paying for torch, tensorflow, xgboost or lightgbm.
"""

from hydra.core.config_store import ConfigStore


def register_schemas(cs: ConfigStore) -> None:
    from trainers.ddp.config import DDPConfig
    from trainers.lightgbm.config import LightGBMConfig
    from trainers.mwms.config import MWMSConfig
    from trainers.xgboost.config import XGBoostConfig

    for name, schema in [("ddp", DDPConfig), ("mwms", MWMSConfig), ("xgboost", XGBoostConfig),
                         ("lightgbm", LightGBMConfig)]:
        cs.store(group="trainer", name=f"{name}_schema", node=schema)
