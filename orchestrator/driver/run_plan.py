"""Everything decided on the driver before Ray starts: the run's name, where its checkpoints
go, what it resumes from. Every check that can fail on input fails here, with exit 2."""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf, open_dict

from orchestrator.checkpoint.retry import Backoff, with_retries
from orchestrator.checkpoint.store import (
    CheckpointRef,
    CheckpointStore,
    CorruptCheckpoint,
    open_source,
)
from orchestrator.config.once import decided_once
from orchestrator.config.schema import Config, DataConfig
from orchestrator.data.datasets import DataFacts, check_parquet, data_facts, eval_config
from orchestrator.data.nonfinite import check_finite
from orchestrator.data.streaming import StreamPlan, plan_stream
from orchestrator.errors import ConfigError, one_line
from orchestrator.storage.check import check_storage, create_bucket
from orchestrator.storage.location import Credentials, StorageSpec, absolute


@dataclass(frozen=True)
class RunPlan:
    run_name: str
    run_storage: StorageSpec  # this run's checkpoint folder
    resume_source: StorageSpec | None  # resume=<uri>
    resume_step: int | None  # the step the run will start from, if not 0
    created_bucket: bool = False  # made by make_plan: removed again if a later check refuses
    stream: StreamPlan | None = None  # streamed parquet (orchestrator/data/streaming.py)


# data keys that say how to go on, not what the batches are: rerunning with one of them
# changed (data.on_change=continue, as a refusal advises) resumes the same run.
NOT_THE_RUNS_DATA = ("on_change", "num_workers", "max_row_group_mb")


def derive_run_name(trainer: dict, data: dict, seed: int, label: str | None = None) -> str:
    """The same trainer, data and seed give the same name, so rerunning a command resumes it.
    The cluster is left out on purpose: a run may resume at another world size. ``label``:
    what the run trains on, where the data's name does not say it (a script's name)."""
    data = {k: v for k, v in data.items() if k not in NOT_THE_RUNS_DATA}
    key = json.dumps({"trainer": trainer, "data": data, "seed": seed}, sort_keys=True, default=str)
    middle = re.sub(r"[^A-Za-z0-9_.-]+", "_", label or "").strip("._") or data.get("name", "data")
    return f"{trainer.get('name', 'run')}-{middle}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def storage_spec(cfg: Config) -> StorageSpec:
    return StorageSpec(absolute(cfg.storage.uri), cfg.storage.endpoint, cfg.storage.region,
                       Credentials.from_env(), cfg.storage.create_bucket)


def complete_data(cfg_node: DictConfig, cfg: Config) -> None:
    """Check the input data and fill in data.features, data.outputs and data.task where the
    config leaves them null, from the data itself (a parquet file's schema and label column),
    so that the trainer's interpolations (trainer.model.in_features: ${data.features})
    resolve to the real shape. Once per command (orchestrator/config/once.py)."""
    data: DataConfig = cfg.data
    storage = storage_spec(cfg)
    keys = [OmegaConf.to_container(cfg_node.data, resolve=True), storage.uri, storage.endpoint]
    facts = decided_once("data", keys, lambda: checked_data_facts(data, storage))
    if facts is None:
        return
    with open_dict(cfg_node.data):
        for key in ("features", "outputs", "task"):
            if OmegaConf.select(cfg_node, f"data.{key}") is None:
                cfg_node.data[key] = getattr(facts, key)
                setattr(data, key, getattr(facts, key))


def checked_data_facts(data: DataConfig, storage: StorageSpec) -> DataFacts | None:
    """Parquet checked (schema; values, whatever the config says of its shape: a NaN feature
    makes a NaN loss, orchestrator/data/nonfinite.py; data.eval_path likewise), opened once
    for all of it; then the facts the config leaves out, or None when it gives them all."""
    opened = check_parquet(data, storage) if data.name == "parquet" else None
    if opened is not None:
        check_finite(data, opened)
        if data.eval_path:
            held_out = check_parquet(eval_config(data), storage, "data.eval_path")
            refuse_shared_files(data, opened.files, held_out.files)
    if data.name == "torch" or None not in (data.features, data.outputs, data.task):
        return None
    return data_facts(data, storage, opened)


def refuse_shared_files(data: DataConfig, train: list[str], held_out: list[str]) -> None:
    """A folder's parquet files are read recursively: data.eval_path=events/holdout under
    data.path=events would be trained on, and its metrics would flatter the model."""
    shared = sorted(set(train) & set(held_out))
    if shared:
        raise ConfigError(
            f"data.eval_path={data.eval_path!r}: {len(shared)} of its files are data.path's too "
            f"({shared[0]}): held-out rows would be trained on; give data.path a glob that "
            f"leaves them out ({str(data.path).rstrip('/')}/*.parquet) or folders apart")


LISTING_BACKOFF = Backoff(0.5, 5.0, 30.0)  # a throttled or blinking store, before any start


def committed_checkpoints(store: CheckpointStore) -> list[CheckpointRef]:
    """The run's committed checkpoints, oldest first; a store that cannot be listed (after a
    few tries) is one line, not a traceback."""
    try:
        return with_retries(f"listing {store.spec.uri}", store.committed, LISTING_BACKOFF)
    except OSError as exc:
        raise ConfigError(f"storage.uri={store.spec.uri!r}: the run's checkpoints cannot be "
                          f"listed ({one_line(exc)[:200]})") from None


def data_position(store: CheckpointStore, refs: list[CheckpointRef]) -> dict | None:
    """The data position of the newest checkpoint whose manifest reads (a corrupt one is
    skipped, as the workers skip it: newest_intact), or None."""
    for ref in reversed(refs):
        try:
            meta = store.read_manifest(ref).get("meta", {})
        except (CorruptCheckpoint, OSError, ValueError, AttributeError):
            continue
        return meta.get("data") if isinstance(meta, dict) else None
    return None


def make_plan(cfg: Config, trainer: dict, data: dict, streams: bool = False,
              label: str | None = None) -> RunPlan:
    """``streams``: the training function reads streamed data (TrainingInfo.streams);
    ``label``: what a derived run name says it trains on (TrainingInfo.run_label)."""
    storage = storage_spec(cfg)
    bucket_missing = check_storage(storage)
    name = cfg.run.name or derive_run_name(trainer, data, cfg.seed, label)
    if cfg.run.name is None and cfg.resume == "never":
        name += time.strftime("-%Y%m%d-%H%M%S")  # a fresh start gets a fresh folder
    run_storage = storage.child(name)
    committed = [] if bucket_missing else committed_checkpoints(CheckpointStore(run_storage))
    latest = committed[-1] if committed else None

    if cfg.resume == "never" and latest is not None:
        raise ConfigError(
            f"resume='never' but run.name={name!r} already has committed checkpoints "
            f"(newest: step {latest.step} in {run_storage.uri}); starting over would overwrite "
            "them: choose another run.name, or resume=auto"
        )
    source, step = None, (latest.step if latest else None)
    resumed = (CheckpointStore(run_storage), committed) if latest else None
    if cfg.resume not in ("auto", "never"):
        source = storage.sibling(cfg.resume, "resume")
        try:
            found = open_source(source)
        except OSError as exc:
            raise ConfigError(f"resume={cfg.resume!r}: cannot read it ({one_line(exc)[:200]})") from None
        if found is None:
            raise ConfigError(
                f"resume={cfg.resume!r}: no committed checkpoint there (expected a step_* "
                "folder with a manifest.json, or a run folder holding some)"
            )
        step = step if latest else found[1].step
        resumed = resumed or (found[0], [found[1]])

    stream = None
    if cfg.data.name == "parquet":  # checked by complete_data, which ran first
        position = data_position(*resumed) if resumed else None
        stream = plan_stream(cfg.data, storage, cfg.seed, None if streams else trainer.get("name"),
                             cfg.cluster.workers, trainer.get("batch_size"),
                             cfg.data.task or "classification", position)
    if bucket_missing:  # every check passed: only now is anything written
        create_bucket(storage)
    return RunPlan(name, run_storage, source, step, created_bucket=bucket_missing, stream=stream)
