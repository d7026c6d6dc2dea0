"""Opening a run's MLflow run: a new one, or the one its checkpoints name (a resume)."""

from __future__ import annotations

import re

from orchestrator.tracking.uri import shown

RUN_FILE = "mlflow.json"  # beside the run's checkpoints: the MLflow run a resume continues
PARAM_KEY_MAX, PARAM_VALUE_MAX, PARAMS_BATCH = 250, 6000, 100  # MLflow's limits
_NOT_IN_A_KEY = re.compile(r"[^\w\-. /]")  # what MLflow refuses in a param's name


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: dotted keys (trainer.optimizer.lr), values as text."""
    params: dict[str, str] = {}
    for name, value in config.items():
        key = _NOT_IN_A_KEY.sub("_", f"{prefix}{name}")[:PARAM_KEY_MAX]
        if isinstance(value, dict) and value:
            params.update(flat_params(value, key + "."))
        else:
            params[key] = str(value)[:PARAM_VALUE_MAX]
    return params


def open_run(client, run) -> tuple[str, str, bool, dict[str, int]]:
    """(the MLflow run's id, its experiment's, whether it continues one, each metric's last
    step logged)."""
    kept = run.store.read_run_record(RUN_FILE) if run.store is not None else None
    if kept and kept.get("uri") == shown(run.uri):
        found = existing(client, kept.get("run_id"))
        if found is not None:
            return (found.info.run_id, found.info.experiment_id, True,
                    continue_run(client, found, run))
    eid = experiment_id(client, run.experiment)
    created = client.create_run(eid, run_name=run.run_name, tags=run.tags)
    run_id = created.info.run_id
    if run.store is not None:
        run.store.write_run_record(RUN_FILE, {"run_id": run_id, "uri": shown(run.uri),
                                                   "experiment_id": eid})
    log_params(client, run_id, run.params)
    return run_id, eid, False, {}


def existing(client, run_id: str | None):
    """The kept run, if the server still has it (not deleted)."""
    if not run_id:
        return None
    try:
        found = client.get_run(run_id)
    except Exception as exc:  # deleted for good, or another server behind the same URI
        if "RESOURCE_DOES_NOT_EXIST" in str(exc) or "not found" in str(exc).lower():
            return None
        raise
    return found if found.info.lifecycle_stage == "active" else None


def continue_run(client, found, run) -> dict[str, int]:
    """Mark the run running again; log the params it lacks (a changed one as a tag, since a
    param is written once); return each metric's last step, not to be logged again."""
    from mlflow.entities import RunTag

    run_id = found.info.run_id
    client.update_run(run_id, status="RUNNING")
    had = found.data.params
    log_params(client, run_id, {k: v for k, v in run.params.items() if k not in had})
    changed = [RunTag(f"resumed_with.{k}"[:PARAM_KEY_MAX], v) for k, v in run.params.items()
               if k in had and had[k] != v]
    if changed:
        client.log_batch(run_id, tags=changed[:PARAMS_BATCH])
    return {key: max((m.step for m in client.get_metric_history(run_id, key)), default=-1)
            for key in found.data.metrics}


def log_params(client, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param

    items = sorted(params.items())
    for i in range(0, len(items), PARAMS_BATCH):
        client.log_batch(run_id, params=[Param(k, v) for k, v in items[i:i + PARAMS_BATCH]])


def experiment_id(client, name: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None and found.lifecycle_stage == "active":
        return found.experiment_id
    if found is not None:
        raise ValueError(f"tracking.experiment={name!r} is deleted in MLflow: restore it, or "
                         "choose another name")
    return client.create_experiment(name)
