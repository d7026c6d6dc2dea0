"""Everything decided on the driver before Ray starts: the run's name, where its checkpoints
go, what it resumes from. Every check that can fail on input fails here, with exit 2."""

from __future__ import annotations

import hashlib
import json
import logging
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
from orchestrator.data.fingerprint import META_KEY as FINGERPRINT_KEY
from orchestrator.data.fingerprint import data_fingerprint, what_changed
from orchestrator.data.manifest import list_files
from orchestrator.data.nonfinite import check_finite
from orchestrator.data.streaming import StreamPlan, plan_stream
from orchestrator.data.text_data import converted
from orchestrator.errors import ConfigError, one_line
from orchestrator.redaction import redact
from orchestrator.storage.check import check_storage, create_bucket
from orchestrator.storage.location import Credentials, StorageSpec, absolute

log = logging.getLogger("orchestrator")


@dataclass(frozen=True)
class RunPlan:
    run_name: str
    run_storage: StorageSpec  # this run's checkpoint folder
    resume_source: StorageSpec | None  # resume=<uri>
    resume_step: int | None  # the step the run will start from, if not 0
    created_bucket: bool = False  # made by make_plan: removed again if a later check refuses
    stream: StreamPlan | None = None  # streamed parquet (orchestrator/data/streaming.py)
    data_files: dict | None = None  # {file: SHA-256} of the data (orchestrator/data/fingerprint.py)
    finished: dict | None = None  # finished.json of a finished run asked for nothing more


# data keys that say how to go on, not what the batches are: rerunning with one of them
# changed (data.on_change=continue, as a refusal advises) resumes the same run.
NOT_THE_RUNS_DATA = ("on_change", "num_workers", "max_row_group_mb")
# trainer keys that say how long to train, not what: growing one continues the same run.
LENGTH_KEYS = ("epochs", "max_steps", "num_boost_round", "steps", "num_epochs", "max_epochs",
               "total_steps")
# trainer keys that say how the model is laid out over the workers, as the cluster's size
# does (pipeline and tensor parallel degrees): a run resumes at others.
LAYOUT_KEYS = ("pipeline", "tensor")
FINISHED = "finished.json"  # beside a run's checkpoints, written when the run succeeded


def run_identity(trainer: dict, data: dict, seed: int) -> dict:
    """What makes a run this run: its trainer but for how long it trains, its data but for
    how it is read, its seed. The cluster and the model's layout over it are left out: a run
    may resume at another size and other degrees."""
    data = {k: v for k, v in data.items() if k not in NOT_THE_RUNS_DATA}
    for key, source in (("path", "source"), ("eval_path", "eval_source")):
        if data.get(source):  # a CSV's parquet copy: the data is what the user named
            data[key] = data[source]
        data.pop(source, None)
    return {"trainer": {k: v for k, v in trainer.items()
                        if k not in LENGTH_KEYS and k not in LAYOUT_KEYS},
            "data": data, "seed": seed}


def run_length(trainer: dict) -> dict:
    return {k: trainer[k] for k in LENGTH_KEYS if k in trainer}


def derive_run_name(trainer: dict, data: dict, seed: int, label: str | None = None) -> str:
    """The same trainer, data and seed give the same name, so rerunning a command resumes it
    (run_identity: a longer run of it too). ``label``: what the run trains on, where the
    data's name does not say it (a script's name)."""
    key = json.dumps(run_identity(trainer, data, seed), sort_keys=True, default=str)
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
    if data.name == "parquet":
        copies = decided_once("text data", [data.path, data.eval_path, data.label, storage.uri,
                                            storage.endpoint],
                              lambda: text_data_copies(data, storage))
        with open_dict(cfg_node.data):
            for key, (source_key, copy) in copies.items():
                cfg_node.data[source_key] = getattr(data, key)
                cfg_node.data[key] = copy
                setattr(data, source_key, getattr(data, key))
                setattr(data, key, copy)
    keys = [OmegaConf.to_container(cfg_node.data, resolve=True), storage.uri, storage.endpoint]
    facts = decided_once("data", keys, lambda: as_the_user_named_it(
        data, lambda: checked_data_facts(data, storage)))
    if facts is None:
        return
    with open_dict(cfg_node.data):
        for key in ("features", "outputs", "task"):
            if OmegaConf.select(cfg_node, f"data.{key}") is None:
                cfg_node.data[key] = getattr(facts, key)
                setattr(data, key, getattr(facts, key))


def as_the_user_named_it(data: DataConfig, check):
    """``check()``, its refusal naming a CSV's path as the user gave it, not its copy's."""
    try:
        return check()
    except ConfigError as exc:
        message = str(exc)
        for key, source_key in (("path", "source"), ("eval_path", "eval_source")):
            if getattr(data, source_key):
                message = message.replace(repr(getattr(data, key)), repr(getattr(data, source_key)))
        if message == str(exc):
            raise
        raise ConfigError(message) from None


def text_data_copies(data: DataConfig, storage: StorageSpec) -> dict[str, tuple[str, str]]:
    """{"path": ("source", the parquet copy's URI), ...} of data.path and data.eval_path where
    they name CSV or JSON lines files (orchestrator/data/text_data.py)."""
    copies = {}
    for key, source_key in (("path", "source"), ("eval_path", "eval_source")):
        path = getattr(data, key)
        if path and not getattr(data, source_key):
            copy = converted(storage.sibling(path, f"data.{key}"), storage, data.label,
                             f"data.{key}")
            if copy is not None:
                copies[key] = (source_key, copy)
    return copies


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


def newest_meta(store: CheckpointStore, refs: list[CheckpointRef]) -> tuple[int, dict] | None:
    """(step, meta) of the newest checkpoint whose manifest reads (a corrupt one is skipped,
    as the workers skip it: newest_intact), or None."""
    for ref in reversed(refs):
        try:
            meta = store.read_manifest(ref).get("meta", {})
        except (CorruptCheckpoint, OSError, ValueError, AttributeError):
            continue
        return ref.step, meta if isinstance(meta, dict) else {}
    return None


def current_data_files(data: DataConfig, storage: StorageSpec) -> dict[str, str] | None:
    """{file: SHA-256} of the data the run reads from files (orchestrator/data/fingerprint.py),
    None for data that is not read from files."""
    if data.name != "parquet":
        return None
    files: dict[str, str] = {}
    for key, path in (("data.path", data.source or data.path),
                      ("data.eval_path", data.eval_source or data.eval_path)):
        if path:
            spec = storage.sibling(path, key)
            fs, inside = spec.filesystem()
            files.update(data_fingerprint(spec, list_files(fs, inside, key), key))
    return files


def data_change(data: DataConfig, name: str, step: int, before: dict, now: dict) -> bool:
    """Whether the run starts again (data.on_change=restart) over data that changed since its
    checkpoint at ``step``; refused (the default) with one line."""
    change = what_changed(before, now)
    if change is None:
        return False
    if data.on_change == "refuse":
        raise ConfigError(
            f"data.path={data.source or data.path!r} changed since run {name}'s checkpoint at "
            f"step {step} "
            f"({change}): training on would mix two versions of the data; start a new run "
            f"(run.name=<another name>), or set data.on_change=restart (train again from step "
            f"0 over the data as it is now) or data.on_change=continue (go on from step {step})")
    return data.on_change == "restart"


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
        source, found = given_source(cfg, storage)
        step = step if latest else found[1].step
        resumed = resumed or (found[0], [found[1]])

    data_files = current_data_files(cfg.data, storage)  # checked by complete_data, which ran first
    newest = newest_meta(*resumed) if resumed else None
    finished = None if bucket_missing or cfg.resume != "auto" else \
        CheckpointStore(run_storage).read_run_record(FINISHED)
    if finished is not None and finished.get("checkpoint_step") != (latest.step if latest else None):
        finished = None  # trained on since it finished (a longer run, interrupted)
    restart, content_changed = judge_data(cfg.data, name, data_files, newest, finished)
    if restart:  # from step 0: the checkpoints are removed below, once every check passed
        source, step, resumed, newest, finished = None, None, None, None, None
    if finished is not None and nothing_to_train(cfg, finished, trainer, data, name):
        return RunPlan(name, run_storage, None, finished.get("step"), finished=finished)

    stream = None
    if cfg.data.name == "parquet":
        position = newest[1].get("data") if newest else None
        stream = plan_stream(cfg.data, storage, cfg.seed, None if streams else trainer.get("name"),
                             cfg.cluster.workers, trainer.get("batch_size"),
                             cfg.data.task or "classification", position,
                             content_changed)
    if bucket_missing:  # every check passed: only now is anything written
        create_bucket(storage)
    if restart:
        restart_run(CheckpointStore(run_storage), committed)
    return RunPlan(name, run_storage, source, step, created_bucket=bucket_missing, stream=stream,
                   data_files=data_files)


def given_source(cfg: Config, storage: StorageSpec) -> tuple[StorageSpec, tuple]:
    """resume=<uri>: where it is, and (its store, its checkpoint)."""
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
    return source, found


def judge_data(data: DataConfig, name: str, now: dict | None, newest: tuple[int, dict] | None,
               finished: dict | None) -> tuple[bool, bool | None]:
    """(whether the run starts again over changed data, whether its content changed: None
    where the run's checkpoints keep no digests to compare)."""
    before = (newest[1] if newest else finished or {}).get(FINGERPRINT_KEY)
    if now is None or not isinstance(before, dict):
        return False, None
    step = newest[0] if newest else (finished or {}).get("step", 0)
    return data_change(data, name, step, before, now), what_changed(before, now) is not None


def restart_run(store: CheckpointStore, committed: list[CheckpointRef]) -> None:
    """data.on_change=restart: the run's checkpoints over the data before are removed (a
    worker would resume from them), and its finished record."""
    for ref in reversed(committed):
        store.discard(ref)
    store.discard_run_record(FINISHED)
    log.warning("data.on_change=restart: removed run %s's %d checkpoints over the data before; "
                "training starts at step 0", store.spec.uri, len(committed))


def nothing_to_train(cfg: Config, finished: dict, trainer: dict, data: dict, name: str) -> bool:
    """A rerun of a finished run: True where it asks for nothing more (the command says so and
    starts no worker); False where it asks for more steps (it goes on). Other settings than
    the finished run's are refused: a run is one model trained one way."""
    when = finished.get("finished_at", "?")
    step = finished.get("step")
    now = json.loads(json.dumps(redact(run_identity(trainer, data, cfg.seed)), default=str))
    then, now = flat(finished.get("identity") or {}), flat(now)
    differ = sorted(k for k in set(then) | set(now) if then.get(k, MISSING) != now.get(k, MISSING))
    if differ:
        shown = ", ".join(f"{k} ({then.get(k, 'unset')} then, {now.get(k, 'unset')} now)"
                          for k in differ[:3])
        more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
        raise ConfigError(
            f"run.name={name!r} finished at step {step} on {when} with other settings: "
            f"{shown}{more}; a finished run is not trained on with other settings: give this "
            "one another run.name (or leave run.name out: a derived name follows the settings)")
    then_length, now_length = finished.get("length") or {}, run_length(trainer)
    return not any(longer(then_length.get(k), v) for k, v in now_length.items())


MISSING = object()


def longer(then, now) -> bool:
    """Whether a length key asks for more than it did (null: no bound)."""
    if then == now:
        return False
    if now is None:
        return True
    return then is not None and isinstance(now, int | float) and isinstance(then, int | float) \
        and now > then


def flat(tree: dict, prefix: str = "") -> dict:
    """{"trainer.lr": 0.1, ...}: nested keys joined by dots, as the command line names them."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def finished_record(plan: RunPlan, cfg: Config, trainer: dict, data: dict, final: dict) -> dict:
    """What finished.json keeps of a run that succeeded: its end, and what it was."""
    store = CheckpointStore(plan.run_storage)
    latest = store.latest()
    return {"run_name": plan.run_name, "step": final.get("steps"),
            "finished_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "checkpoint_step": latest.step if latest else None,
            "metrics": final.get("metrics") or {}, "train_metrics": final.get("train_metrics") or {},
            "total_steps": final.get("total_steps"), "wall_s": final.get("wall_s"),
            "trainer": final.get("trainer"), "identity": redact(run_identity(trainer, data, cfg.seed)),
            "length": run_length(trainer), FINGERPRINT_KEY: plan.data_files}
