"""The sweeper's own config (hydra.sweeper.*), typed like the rest, checked before any trial."""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from orchestrator.config.rules import require, require_path_name

SEARCHES = ("grid", "random", "optuna")
SWEEPER_TARGET = "hydra_plugins.orchestrator_sweeper.ray_tune_sweeper.RayTuneSweeper"


@dataclass
class EarlyStoppingConf:
    enabled: bool = False
    # ASHA compares trials at steps grace_period * reduction_factor**k; a trial below the
    # top 1/reduction_factor of those that reached the same step stops there.
    grace_period: int = 50  # steps (boosting rounds) before a trial may be stopped
    reduction_factor: int = 2
    max_t: int = 1_000_000  # the step after which no trial is stopped


@dataclass
class RayTuneSweeperConf:
    _target_: str = SWEEPER_TARGET
    name: str | None = None  # null = derived from the sweep's overrides (the same name resumes)
    params: dict[str, str] = field(default_factory=dict)  # key: Hydra sweep syntax
    search: str = "grid"  # grid | random | optuna (TPE)
    num_samples: int = 1  # random/optuna: trials to run; grid: repeats of the grid
    metric: str = "test_accuracy"  # a metric the trainers report
    mode: str = "max"  # max | min
    max_concurrent: int | None = None  # null = as many trials as have a CPU each, at most 4
    early_stopping: EarlyStoppingConf = field(default_factory=EarlyStoppingConf)

    def __post_init__(self) -> None:
        check_sweeper(self)


def check_sweeper(conf: RayTuneSweeperConf) -> None:
    key = "hydra.sweeper"
    if conf.name is not None:  # the sweep's folder under hydra.sweep.dir
        require_path_name(f"{key}.name", conf.name, nullable=True)
    require(conf.search in SEARCHES, f"{key}.search", conf.search, "one of " + ", ".join(SEARCHES))
    require(conf.num_samples >= 1, f"{key}.num_samples", conf.num_samples, "an integer >= 1")
    require(conf.mode in ("max", "min"), f"{key}.mode", conf.mode, "max or min")
    require(bool(conf.metric.strip()), f"{key}.metric", conf.metric, "a metric name")
    if conf.max_concurrent is not None:
        require(conf.max_concurrent >= 1, f"{key}.max_concurrent", conf.max_concurrent,
                "null or an integer >= 1")
    es = conf.early_stopping
    require(es.grace_period >= 1, f"{key}.early_stopping.grace_period", es.grace_period,
            "an integer >= 1")
    require(es.reduction_factor >= 2, f"{key}.early_stopping.reduction_factor",
            es.reduction_factor, "an integer >= 2")
    require(es.max_t > es.grace_period, f"{key}.early_stopping.max_t", es.max_t,
            f"an integer > grace_period ({es.grace_period})")


def register_sweeper(cs: ConfigStore) -> None:
    cs.store(group="hydra/sweeper", name="ray_tune", node=RayTuneSweeperConf, provider="orchestrator")
