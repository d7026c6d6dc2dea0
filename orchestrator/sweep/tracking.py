"""A sweep's MLflow run: the parent of its trials' runs (each trial's run is nested in it by
its own driver, orchestrator/tracking/), with the scaling report as artifacts. A resumed sweep
continues it (its id kept in the sweep's folder)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from orchestrator.errors import ConfigError, one_line
from orchestrator.redaction import redact_text
from orchestrator.sweep.space import SweepSpace
from orchestrator.tracking.uri import run_page, shown, tracking_uri

log = logging.getLogger("orchestrator")

PARENT_FILE = "mlflow.json"
STATUS = {0: "FINISHED", 1: "FAILED", 130: "KILLED"}


@dataclass
class ParentRun:
    client: object
    run_id: str
    experiment: str  # its name: the trials' runs go to the same experiment, to nest there


def open_parent(config: DictConfig, name: str, sweep_dir: Path,
                space: SweepSpace) -> ParentRun | None:
    """The sweep's run (None with tracking=none, or with tracking.required=false and a server
    that does not answer: the trials' runs are then not nested). ConfigError otherwise."""
    tracking = config.tracking
    if tracking.name == "none":
        return None
    uri = tracking_uri(tracking.uri)
    experiment = tracking.experiment or f"{config.trainer.get('name')}-{config.data.name}"
    try:
        return ParentRun(*parent_run(uri, experiment, name, sweep_dir, space), experiment)
    except Exception as exc:  # noqa: BLE001  (the server's or MLflow's error, said in one line)
        problem = f"tracking.uri={shown(uri)}: MLflow did not open the sweep's run " \
                  f"({shown(one_line(exc))[:300]})"
        if tracking.required:
            raise ConfigError(problem + "; or set tracking.required=false") from exc
        log.warning("%s: its trials' runs are not nested in one", problem)
        return None


def parent_run(uri: str, experiment: str, name: str, sweep_dir: Path,
               space: SweepSpace) -> tuple[object, str]:
    from mlflow.tracking import MlflowClient

    from orchestrator.tracking.mlflow_open import existing, experiment_id, log_params
    from orchestrator.tracking.mlflow_run import quick_failures

    quick_failures()
    client = MlflowClient(tracking_uri=uri)
    kept_file = sweep_dir / PARENT_FILE
    kept = json.loads(kept_file.read_text()) if kept_file.exists() else {}
    if kept.get("uri") == shown(uri) and existing(client, kept.get("run_id")) is not None:
        client.update_run(kept["run_id"], status="RUNNING")
        log.info("MLflow: the sweep continues its run %s", kept["run_id"])
        return client, kept["run_id"]
    eid = experiment_id(client, experiment)
    run_id = client.create_run(eid, run_name=name, tags={"orchestrator.sweep": name}).info.run_id
    log_params(client, run_id, {"sweep.fixed": redact_text(" ".join(space.fixed))[:6000],
                                **{f"sweep.{d.key}": redact_text(described(d))[:6000]
                                   for d in space.dimensions}})
    kept_file.write_text(json.dumps({"run_id": run_id, "uri": shown(uri)}) + "\n")
    log.info("MLflow: the sweep is run %s; each trial's run is nested in it",
             run_page(uri, eid, run_id))
    return client, run_id


def described(dim) -> str:
    """A dimension as its override said it: choice(a,b), interval(lo,hi), tag(log,...)."""
    if dim.discrete:
        return ",".join(dim.values)
    return f"{'tag(log, ' if dim.log else ''}interval({dim.low}, {dim.high}){')' if dim.log else ''}"


def end_parent(parent: ParentRun | None, code: int, paths: dict[str, Path]) -> None:
    """The report as the parent's artifacts, and its status; a server away is a warning."""
    if parent is None:
        return
    try:
        for path in paths.values():
            parent.client.log_artifact(parent.run_id, str(path))
        parent.client.set_terminated(parent.run_id, STATUS.get(code, "FAILED"))
    except Exception as exc:  # noqa: BLE001  (the trials are done: only the report is late)
        log.warning("MLflow: the sweep's report was not attached to its run %s (%s)",
                    parent.run_id, shown(one_line(exc))[:300])
