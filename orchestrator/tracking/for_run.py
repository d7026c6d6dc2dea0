"""The tracking of one run, as the driver starts, feeds and ends it."""

from __future__ import annotations

import logging
import subprocess

from orchestrator.config.schema import TrackingConfig
from orchestrator.errors import ConfigError
from orchestrator.redaction import redact_text
from orchestrator.tracking.uri import shown, tracking_uri

log = logging.getLogger("orchestrator")

OPEN_WITHIN_S = 120.0  # MLflow's import on a busy machine, and the run's creation


def start_tracking(tracking: TrackingConfig, plan, trainer: str, data: str, config: dict,
                   command_dir: str):
    """The run's tracker, its thread started (MLflow's import overlaps Ray's start), or None
    with tracking=none. ``config``: the run's config, redacted."""
    if tracking.name == "none":
        return None
    from orchestrator.checkpoint.store import CheckpointStore
    from orchestrator.tracking.mlflow_open import flat_params
    from orchestrator.tracking.mlflow_run import MlflowTracker, TrackedRun

    tags = {"orchestrator.trainer": trainer, "orchestrator.run_name": plan.run_name,
            "orchestrator.data": data}
    commit = git_commit(command_dir)
    if commit:
        tags["mlflow.source.git.commit"] = commit
    if tracking.parent_run_id:
        tags["mlflow.parentRunId"] = tracking.parent_run_id
    overrides = hydra_overrides()
    if overrides:
        tags["orchestrator.overrides"] = redact_text(" ".join(overrides))[:5000]
    return MlflowTracker(TrackedRun(
        uri=tracking_uri(tracking.uri), experiment=tracking.experiment or f"{trainer}-{data}",
        run_name=plan.run_name, params=flat_params(config), tags=tags, buffer=tracking.buffer,
        flush_s=tracking.flush_s, store=CheckpointStore(plan.run_storage)))


def open_tracking(tracker, tracking: TrackingConfig) -> None:
    """Open (or continue) the MLflow run once every check passed, before any worker starts:
    a server that cannot is exit 2 unless tracking.required=false (then it is retried while
    the run trains)."""
    if tracker is None:
        return
    tracker.begin()
    problem = tracker.opened(OPEN_WITHIN_S)
    if problem is None:
        verb = "continuing" if tracker.resumed else "new"
        log.info("MLflow: %s run %s (experiment %r)", verb, tracker.where(),
                 tracker.run.experiment)
    elif tracking.required:
        raise ConfigError(f"tracking.uri={shown(tracker.run.uri)}: MLflow did not open the run "
                          f"({problem}); correct it, or set tracking.required=false to train "
                          "without it until it answers")


def checked_tracking(cfg) -> str | None:
    """uri.check_tracking, once per command (the CLI's checks and the run's launch)."""
    from orchestrator.config.once import decided_once
    from orchestrator.tracking.uri import check_tracking

    t = cfg.tracking
    return decided_once("tracking", [t.name, t.uri, t.required],
                        lambda: check_tracking(t.name, t.uri, t.required))


def git_commit(folder: str) -> str | None:
    """The commit of the user's folder, when it is in a git repository."""
    try:
        out = subprocess.run(["git", "-C", folder, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def hydra_overrides() -> list[str]:
    """The command's overrides (a sweep's trial: its own), as Hydra has them."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except (ImportError, ValueError):
        return []
