"""A sweep's metric, checked before any trial starts: a search or scheduler that compares
trials as they go needs every trial to report it, and a metric no trial reports would
otherwise fail each one after it trained."""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.errors import ConfigError
from orchestrator.sweep.config import RayTuneSweeperConf

# What every trial reports to Tune besides its run's metrics (trial.py Progress): the metric
# may be one of these too (samples_per_s, for a search over throughput).
RUN_FIGURES = ("samples_per_s", "wall_s", "step", "workers", "world_size", "restarts",
               "preemptions")


def needs_metric(conf: RayTuneSweeperConf) -> bool:
    """Optuna and ASHA compare trials by the metric as they go; grid and random need none."""
    return conf.search == "optuna" or conf.early_stopping.enabled


def check_metric(metric: str, reported: Sequence[str] | None, task: str | None) -> None:
    """ConfigError when the run's training function said what it reports (``reported``, from
    its check; None: it did not say) and ``metric`` is not among it."""
    if reported is None or metric in reported or metric in RUN_FIGURES:
        return
    where = f" (data.task={task})" if task else ""
    names = ", ".join(reported) or "no metric"
    raise ConfigError(f"hydra.sweeper.metric={metric!r} is not reported by this run{where}: it "
                      f"reports {names}, and every trial's {', '.join(RUN_FIGURES)}")
