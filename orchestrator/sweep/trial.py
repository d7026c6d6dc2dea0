"""One trial of a sweep, run by Ray Tune in a trial actor on the sweep driver's node.

The trial composes its config with Hydra (the sweep's overrides plus the values Tune chose),
runs the orchestrated job through Hydra's run_job (its own output directory, .hydra files,
log file), and meanwhile reads the job's run.json to report progress to Tune, so that a
scheduler such as ASHA can stop a poor trial early.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from orchestrator.config.once import parts_tried_by_the_sweep
from orchestrator.config.paths import resolve_paths
from orchestrator.driver.scaling import cpu_share
from orchestrator.sweep.space import SweepSpace

POLL_S = 1.0


@dataclass(frozen=True)
class TrialContext:
    """What every trial needs from the sweep driver (shipped once through the object store)."""

    hydra_context: Any
    master_config: DictConfig  # the sweep-level config, Hydra's node included
    singleton_state: Any  # Hydra's ConfigStore and plugins, as the driver has them
    space: SweepSpace
    sweep_dir: str
    sweep_name: str
    metric: str
    cpu_budget: float  # the CPUs one trial's workers share, when cpus_per_worker is not set
    run_name: str  # run.name, else the sweep's name: each trial appends its id
    command_dir: str  # where the command ran: a trial's relative paths are relative to it
    metric_required: bool = True  # the search or scheduler compares trials by the metric
    tracking_parent: tuple[str, str] | None = None  # the sweep's MLflow run: (id, experiment)


def compose_trial(ctx: TrialContext, params: dict, trial_id: str) -> DictConfig:
    """The trial's config; its directory and run name carry Tune's trial id, which a resumed
    sweep keeps."""
    from hydra.core.singleton import Singleton

    from orchestrator.worker.training_function import cluster_keys_given, size_cluster

    Singleton.set_state(ctx.singleton_state)
    overrides = ctx.space.overrides(params)
    cfg = ctx.hydra_context.config_loader.load_sweep_config(ctx.master_config, overrides)
    with open_dict(cfg):
        cfg.hydra.sweep.dir = ctx.sweep_dir
        cfg.hydra.sweep.subdir = trial_id
        cfg.hydra.job.id = trial_id
        # A trainer that sizes the run from its own keys (torchrun's flags of trainer=script)
        # does so before the share is cut: the share is per worker.
        size_cluster(cfg, cluster_keys_given(overrides))
        if cfg.cluster.cpus_per_worker is None:  # concurrent trials share the cluster evenly
            cfg.cluster.cpus_per_worker = cpu_share(ctx.cpu_budget, cfg.cluster.workers)
        cfg.run.name = f"{ctx.run_name}-{trial_id}"  # trials differ: each its own checkpoints
        if ctx.tracking_parent:  # its MLflow run nested in the sweep's, in its experiment
            cfg.tracking.parent_run_id, cfg.tracking.experiment = ctx.tracking_parent
    # The trial runs in Tune's working folder, not in the command's.
    resolve_paths(cfg, Path(ctx.command_dir))
    return cfg


def run_trial(params: dict, ctx: TrialContext) -> None:
    """Ray Tune's function trainable."""
    from hydra.core.utils import run_job
    from ray import tune

    trial_id = tune.get_context().get_trial_id()
    cfg = compose_trial(ctx, params, trial_id)
    out_dir = Path(ctx.sweep_dir) / trial_id
    outcome: dict[str, Any] = {}

    def job() -> None:
        try:
            ret = run_job(hydra_context=ctx.hydra_context, task_function=_task(outcome),
                          config=cfg, job_dir_key="hydra.sweep.dir",
                          job_subdir_key="hydra.sweep.subdir")
            ret.return_value  # noqa: B018  (raises the task's exception, if any)
        except BaseException as exc:  # noqa: BLE001  (reported to Tune below)
            outcome.setdefault("exception", exc)

    # A daemon: if Tune stops this trial early, the actor exits without waiting for it, and
    # Ray ends the job's controller and workers with their owner.
    runner = threading.Thread(target=job, name=f"trial-{trial_id}", daemon=True)
    runner.start()
    progress = Progress(ctx.metric, int(cfg.cluster.workers))
    while runner.is_alive():
        runner.join(POLL_S)
        for update in progress.updates(read_record(out_dir / "run.json")):
            if runner.is_alive():
                tune.report(update)
    record = read_record(out_dir / "run.json") or {}
    if "exception" in outcome:
        raise TrialFailed(f"trial {trial_id}: {outcome['exception']}") from outcome["exception"]
    if record.get("status") == "stopped":
        return  # the scheduler stopped this trial (launch.run_to_end): Tune is ending it
    # already_finished: the trial's run had finished (a sweep resumed after its end was
    # recorded by the run, not yet by Tune): its metrics are the trial's.
    if outcome.get("code") != 0 or record.get("status") not in ("succeeded", "already_finished"):
        raise TrialFailed(f"trial {trial_id} failed (exit code {outcome.get('code')}): "
                          f"{record.get('error') or 'see ' + str(out_dir)}")
    final = progress.final(record)
    if ctx.metric not in final and ctx.metric_required:
        raise TrialFailed(f"trial {trial_id}: hydra.sweeper.metric={ctx.metric!r} was not reported; "
                          f"the run reported {', '.join(sorted(record.get('metrics', {})))}")
    tune.report(final)


class TrialFailed(RuntimeError):
    pass


def _task(outcome: dict):
    def task(cfg: DictConfig) -> int:
        from hydra.core.hydra_config import HydraConfig

        from orchestrator.driver.launch import launch

        with parts_tried_by_the_sweep():  # by the sweep's driver, before any trial
            code = launch(cfg, Path(HydraConfig.get().runtime.output_dir), time.time())
        outcome["code"] = code
        return code

    return task


def read_record(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # not written yet (the record is replaced atomically, never half-written)


class Progress:
    """Turns successive run records into Tune reports: one per new step at which the metric
    is known (a periodic evaluation for test_*, any progress for training metrics)."""

    def __init__(self, metric: str, workers: int):
        self.metric = metric
        self.workers = workers
        self.last_step = -1

    def common(self, record: dict) -> dict:
        sizes = record.get("world_sizes") or [{}]
        return {"workers": self.workers, "world_size": sizes[-1].get("size"),
                "samples_per_s": record.get("samples_per_s"),
                "restarts": record.get("restarts", 0), "preemptions": record.get("preemptions", 0)}

    def updates(self, record: dict | None) -> list[dict]:
        """The reports this record adds: every periodic evaluation since the last one read (a
        scheduler such as ASHA compares trials at given steps, so none is skipped however fast
        the trial runs), else the newest training metrics."""
        if not record:
            return []
        evaluations = [e for e in record.get("evaluations") or [record.get("evaluation") or {}]
                       if self.metric in (e.get("metrics") or {})]
        if evaluations:
            points = [(e["step"], e["metrics"]) for e in evaluations]
        elif self.metric in (record.get("train_metrics") or {}):
            points = [(record.get("steps", 0), record["train_metrics"])]
        else:
            return []
        reports = []
        for step, values in points:
            if step > self.last_step:
                self.last_step = step
                reports.append({"step": step, **as_numbers(values), **self.common(record),
                                "final": False})
        return reports

    def final(self, record: dict) -> dict:
        return {"step": record.get("steps", 0), **as_numbers(record.get("train_metrics") or {}),
                **as_numbers(record.get("metrics") or {}), **self.common(record),
                "wall_s": record.get("wall_s"), "final": True}


def as_numbers(metrics: dict) -> dict:
    """run.json writes a NaN or infinite metric as null (strict JSON): Tune gets a NaN back,
    which its schedulers and searchers take as a failed value."""
    return {k: math.nan if v is None else v for k, v in metrics.items()}
