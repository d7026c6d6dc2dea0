"""Dataclass schemas for every config group; Hydra type-checks overrides against them.

Checks that span fields live in ``__post_init__`` so that ``OmegaConf.to_object`` (which
builds these dataclasses from the composed config) rejects bad input with one line.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from orchestrator.config.rules import require, require_path_name
from orchestrator.service.place import KEEP_ALIVE_MAX_S

RESUME_MODES = ("auto", "never")
PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's placement strategies
PROGRESS_MODES = ("auto", "bar", "lines", "off")
# omegaconf.MISSING, the same string: Ray Train's controller and the workers unpickle these
# classes, and need not import Hydra and OmegaConf for it (~0.1 CPU-s a process)
MISSING = "???"


@dataclass
class ClusterConfig:
    name: str = "local"
    workers: int = 2  # the target size, and the maximum when elastic
    min_workers: int | None = None  # null = fixed size
    cpus_per_worker: float | None = None  # null = share the cluster's CPUs among the workers
    gpus_per_worker: float = 0.0
    address: str | None = None  # null = start an embedded Ray; "auto" or host:port = join one
    num_cpus: int | None = None  # CPUs of the embedded Ray (null = all of this machine's)
    dashboard: bool = True
    dashboard_port: int = 8265
    # The run on the dashboard's Train page (Ray Train's state tracking): its attempts, worker
    # groups, failures and status, on an embedded or a joined cluster
    dashboard_train_page: bool = True
    resize_check_s: float = 60.0  # how often an elastic job looks for room to grow
    # The number of workers is always a multiple of this: the workers that hold one copy of
    # a model cut into stages or split (trainer.pipeline.degree x trainer.tensor.degree set it)
    workers_multiple_of: int = 1
    # How a job's workers are placed: PACK (as few nodes as fit: fast collectives) or SPREAD
    # (over as many nodes as there are: a lost node takes fewer workers with it).
    placement: str = "PACK"
    # Other Ray resources each worker asks for, beyond CPUs and GPUs: custom node resources
    # (+cluster.resources.big_memory=1), accelerator types ({"accelerator_type:A100": 0.001}).
    resources: dict[str, float] = field(default_factory=dict)
    # How long a run may go without a worker group before it stops with a line naming what it
    # asked for and what each node has (exit 1): Ray Train alone would wait forever.
    placement_timeout_s: float = 300.0
    # Seconds a service keeps this command's Ray, its driver and processes ready for the
    # next command after the last one ends (0: none; orchestrator/service/)
    keep_alive: float = 0.0

    @property
    def elastic(self) -> bool:
        """Whether the run may change size: cluster.min_workers below cluster.workers."""
        return self.min_workers is not None and self.min_workers < self.workers

    def __post_init__(self) -> None:
        require(self.workers >= 1, "cluster.workers", self.workers, "an integer >= 1")
        require(0 < self.placement_timeout_s < math.inf, "cluster.placement_timeout_s",
                self.placement_timeout_s, "a number of seconds > 0")
        if self.min_workers is not None:
            require(
                1 <= self.min_workers <= self.workers,
                "cluster.min_workers",
                self.min_workers,
                f"null or an integer in 1..cluster.workers ({self.workers})",
            )
        if self.cpus_per_worker is not None:
            require(0 < self.cpus_per_worker < math.inf, "cluster.cpus_per_worker",
                    self.cpus_per_worker, "null (automatic) or a number > 0")
        require(0 <= self.gpus_per_worker < math.inf, "cluster.gpus_per_worker",
                self.gpus_per_worker, "a number >= 0")
        if self.num_cpus is not None:
            require(self.num_cpus >= 1, "cluster.num_cpus", self.num_cpus, "null or an integer >= 1")
        require(0 <= self.keep_alive <= KEEP_ALIVE_MAX_S, "cluster.keep_alive", self.keep_alive,
                f"a number of seconds from 0 (no service) to {KEEP_ALIVE_MAX_S} (30 days)")
        require(self.resize_check_s > 0, "cluster.resize_check_s", self.resize_check_s,
                "a number of seconds > 0")
        require(self.workers_multiple_of >= 1, "cluster.workers_multiple_of",
                self.workers_multiple_of, "an integer >= 1")
        for key in ("workers", "min_workers"):
            value = getattr(self, key)
            if value is not None:
                require(value % self.workers_multiple_of == 0, f"cluster.{key}", value,
                        f"a multiple of cluster.workers_multiple_of={self.workers_multiple_of}")
        require(self.placement in PLACEMENTS, "cluster.placement", self.placement,
                "one of " + ", ".join(PLACEMENTS))
        if self.address is not None:
            require(self.address.strip() != "", "cluster.address", self.address,
                    "null (embedded Ray), 'auto' or host:port")


@dataclass
class StorageConfig:
    name: str = "local"
    uri: str = "checkpoints"  # a directory, or any URI pyarrow understands (s3://bucket/prefix)
    endpoint: str | None = None  # S3-compatible endpoint, e.g. http://127.0.0.1:8333
    region: str = "us-east-1"
    create_bucket: bool = True  # false: a missing bucket is an input error

    def __post_init__(self) -> None:
        require(self.uri.strip() != "", "storage.uri", self.uri, "a directory or a URI")
        # The kind must mean what it says: storage=s3 with a forgotten `s3://` would otherwise
        # write to a local folder named after the URI while the user believes it is in S3.
        scheme = self.uri.split("://", 1)[0] if "://" in self.uri else None
        if self.name == "s3":
            require(scheme == "s3", "storage.uri", self.uri,
                    "with storage=s3, an s3://bucket/prefix URI (for a directory, use "
                    "storage=local)")
        elif self.name == "local":
            require(scheme != "s3", "storage.uri", self.uri,
                    "with storage=local, a directory (for object storage, use storage=s3, "
                    "which has its endpoint, region and bucket settings)")
        if scheme == "s3":
            from orchestrator.storage.location import check_s3_uri

            check_s3_uri(self.uri)
        if self.endpoint:  # pyarrow takes http and https only, lower-case ("s3://host" is not)
            require(re.fullmatch(r"(https?://)?[^/:\s]+(:\d+)?/?", self.endpoint) is not None,
                    "storage.endpoint", self.endpoint,
                    "http://host:port, https://host or host:port (https), the S3 server's address")


DATA_NAMES = ("digits", "synthetic", "parquet", "torch")
TASKS = ("classification", "regression", "language_model")


@dataclass
class DataConfig:
    name: str = "digits"  # digits | synthetic | parquet | torch (your own datasets)
    # classification | regression | language_model; null: from the data where that is
    # unambiguous (an integer, string or boolean label is classification).
    task: str | None = None
    path: str | None = None  # parquet: a file or directory, local or s3://
    label: str = "label"  # parquet: the label column
    # parquet: the feature columns, in this order (null: every column but the label), so an
    # id, a timestamp or a text column of your data can stay there
    columns: list[str] | None = None
    # Tabular data's shape, for interpolation (trainer.model.in_features: ${data.features}):
    # null = filled in from the data on the driver before anything starts.
    features: int | None = None  # synthetic: the number of features to generate
    outputs: int | None = None  # a model's output width: the classes, or 1 for regression
    # synthetic: the number of classes (null: 2); digits: its 10; parquet: from the label column
    classes: int | None = None
    rows: int | None = None  # synthetic: the number of rows (null: 10,000)
    test_fraction: float = 0.2
    # data=torch: your own map-style datasets and batching, as _target_ nodes.
    train: dict[str, Any] | None = None
    eval: dict[str, Any] | None = None
    collate_fn: dict[str, Any] | None = None
    num_workers: int = 0  # DataLoader processes that prefetch batches
    # Missing, NaN or infinite values (parquet's columns; data=torch: its first items) stop the
    # command with exit 2, counted on the driver; true: train on them (XGBoost and LightGBM
    # take NaN as a missing value).
    allow_nonfinite: bool = False
    # parquet: held out rows from another parquet dataset (null: data.test_fraction of data.path)
    eval_path: str | None = None
    # parquet: auto streams data larger than stream_above_mb decoded (each worker reads only its
    # share, a window of row groups at a time); true | false decide it (docs/data.md)
    stream: str = "auto"
    stream_above_mb: float = 256.0
    shards: int | None = None  # streamed: virtual shards (null: cluster.workers); kept on resume
    window: int = 1  # streamed: row groups a shard shuffles together
    max_row_group_mb: float = 512.0  # streamed: a larger row group (decoded) is refused
    on_change: str = "refuse"  # resuming over data that changed since: refuse | restart | continue
    # Set by the orchestrator: the CSV or JSON lines path that data.path (eval_path) is the
    # parquet copy of (orchestrator/data/text_data.py); the run's identity is made from it.
    source: str | None = None
    eval_source: str | None = None

    def __post_init__(self) -> None:
        require(self.name in DATA_NAMES, "data", self.name, "one of " + ", ".join(DATA_NAMES))
        if self.task is not None:
            require(self.task in TASKS, "data.task", self.task,
                    "null (from the data) or one of " + ", ".join(TASKS))
        require(0 < self.test_fraction < 1, "data.test_fraction", self.test_fraction,
                "a number strictly between 0 and 1")
        require(self.num_workers >= 0, "data.num_workers", self.num_workers, "an integer >= 0")
        self.stream = str(self.stream).lower()
        require(self.stream in ("auto", "true", "false"), "data.stream", self.stream,
                "auto, true or false")
        require(self.stream_above_mb >= 0, "data.stream_above_mb", self.stream_above_mb,
                "a number >= 0")
        if self.shards is not None:
            require(self.shards >= 1, "data.shards", self.shards, "null or an integer >= 1")
        require(self.window >= 1, "data.window", self.window, "an integer >= 1")
        require(self.max_row_group_mb > 0, "data.max_row_group_mb", self.max_row_group_mb,
                "a number > 0")
        require(self.on_change in ("refuse", "restart", "continue"), "data.on_change",
                self.on_change, "refuse, restart or continue")
        if self.eval_path is not None:
            require(self.name == "parquet", "data.eval_path", self.eval_path,
                    "null unless data=parquet")
        if self.name == "synthetic":
            self.classes = 2 if self.classes is None else self.classes
            self.rows = 10_000 if self.rows is None else self.rows
            require(self.rows >= 10, "data.rows", self.rows, "an integer >= 10")
            require(self.features is not None and self.features >= 1, "data.features",
                    self.features, "an integer >= 1")
            require(self.classes >= 2, "data.classes", self.classes, "an integer >= 2")
            require(self.task in (None, "classification", "regression"), "data.task", self.task,
                    "classification or regression for data=synthetic")
        if self.columns is not None:
            self.columns = [str(c) for c in self.columns]
            require(self.name == "parquet", "data.columns", self.columns, "null unless data=parquet")
            require(len(self.columns) >= 1 and len(set(self.columns)) == len(self.columns)
                    and self.label not in self.columns, "data.columns", self.columns,
                    "null, or a list of distinct feature column names without the label "
                    f"({self.label!r})")
        if self.name == "parquet":
            require(bool(self.path), "data.path", self.path,
                    "a parquet file or directory (local path or s3:// URI)")
            require(self.task != "language_model", "data.task", self.task,
                    "classification or regression for data=parquet")
        if self.name == "torch":
            for key in ("train", "eval"):
                node = getattr(self, key)
                require(bool(node) and "_target_" in node, f"data.{key}._target_", None,
                        "the import path of a map-style dataset class or factory")


@dataclass
class CheckpointConfig:
    every_steps: int | None = 50
    every_seconds: float | None = None
    keep: int = 3  # newest committed checkpoints kept (0 = all)
    async_upload: bool = True
    upload_retry_s: float = 600.0  # keep retrying an upload through an outage this long

    def __post_init__(self) -> None:
        if self.every_steps is not None:
            require(self.every_steps >= 1, "checkpoint.every_steps", self.every_steps,
                    "null or an integer >= 1")
        if self.every_seconds is not None:
            require(self.every_seconds > 0, "checkpoint.every_seconds", self.every_seconds,
                    "null or a number > 0")
        require(self.upload_retry_s > 0, "checkpoint.upload_retry_s", self.upload_retry_s,
                "a number of seconds > 0")
        require(self.keep >= 0, "checkpoint.keep", self.keep, "an integer >= 0 (0 keeps all)")


@dataclass
class FailureConfig:
    max_restarts: int = 3
    max_preemptions: int = -1  # -1 = no limit: a preemption is not the job's fault
    hang_timeout_s: float = 30.0  # a worker silent this long (SIGSTOP, deadlock) has failed
    preemption_check_s: float = 1.0  # how often the workers agree on preemption notices
    # This long after its group's start, each worker has its node keep one process ready for
    # the worker that replaces it after a failure (null: never)
    spare_after_s: float | None = 10.0

    def __post_init__(self) -> None:
        require(self.hang_timeout_s >= 5, "failure.hang_timeout_s", self.hang_timeout_s,
                "a number of seconds >= 5")
        require(0 < self.preemption_check_s <= 60, "failure.preemption_check_s",
                self.preemption_check_s, "a number of seconds > 0 and <= 60")
        require(self.max_restarts >= 0, "failure.max_restarts", self.max_restarts,
                "an integer >= 0")
        require(self.max_preemptions >= -1, "failure.max_preemptions", self.max_preemptions,
                "-1 (no limit) or an integer >= 0")
        require(self.spare_after_s is None or self.spare_after_s >= 0, "failure.spare_after_s",
                self.spare_after_s, "a number of seconds >= 0, or null (never)")


@dataclass
class LogConfig:
    ray_verbose: bool = False  # Ray's own lines (workers' output, Train controller) in the terminal
    progress: str = "auto"  # auto: a bar on a terminal, plain lines otherwise | bar | lines | off
    progress_every_s: float = 5.0  # how often a plain progress line is printed
    tensorboard: bool = True  # event files under <run dir>/tensorboard
    metrics: bool = True  # Ray metrics (the node's Prometheus endpoint, the Ray dashboard)

    def __post_init__(self) -> None:
        require(self.progress in PROGRESS_MODES, "log.progress", self.progress,
                "one of " + ", ".join(PROGRESS_MODES))
        require(self.progress_every_s > 0, "log.progress_every_s", self.progress_every_s,
                "a number of seconds > 0")


TRACKERS = ("none", "mlflow")


@dataclass
class TrackingConfig:
    """Where runs are logged besides run.json and TensorBoard (orchestrator/tracking/)."""

    name: str = "none"  # none | mlflow
    uri: str | None = None  # mlflow: http(s)://host:port, file:./mlruns, sqlite:///mlflow.db
    experiment: str | None = None  # null: <trainer>-<data>
    required: bool = True  # false: a server that does not answer at the start is a warning
    buffer: int = 100_000  # metric values kept while the server is away (then the oldest go)
    flush_s: float = 30.0  # at the end, how long the run waits for the server to take the rest
    parent_run_id: str | None = None  # the MLflow run this one is nested in (a sweep's)

    def __post_init__(self) -> None:
        require(self.name in TRACKERS, "tracking", self.name, "one of " + ", ".join(TRACKERS))
        if self.uri is not None:
            require(self.uri.strip() != "", "tracking.uri", self.uri,
                    "http(s)://host:port, file:./mlruns or sqlite:///mlflow.db")
        require(self.buffer >= 1000, "tracking.buffer", self.buffer, "an integer >= 1000")
        require(0 <= self.flush_s <= 3600, "tracking.flush_s", self.flush_s,
                "a number of seconds from 0 to 3600")
        if self.experiment is not None:
            require(self.experiment.strip() != "", "tracking.experiment", self.experiment,
                    "an experiment's name, or null (<trainer>-<data>)")


@dataclass
class RunSection:
    name: str | None = None  # null = derived from trainer, data and seed, so a rerun resumes
    # Rank 0 evaluates on the test split every this many steps (rounds): curves, and the
    # metric a sweep's early stopping compares. null = only at the end.
    eval_every_steps: int | None = None

    def __post_init__(self) -> None:
        if self.eval_every_steps is not None:
            require(self.eval_every_steps >= 1, "run.eval_every_steps", self.eval_every_steps,
                    "null or an integer >= 1")
        if self.name is not None:
            require_path_name("run.name", self.name, nullable=True)


@dataclass
class TrainerConfig:
    """The keys every trainer has; a trainer's own schema (declared with
    orchestrator.worker_api.training_function) extends it."""

    name: str = "function"
    fn: str = MISSING  # the training function, "module:function", run on every worker
    backend: str = "torch"  # what Ray sets up around it (orchestrator/driver/backends.py)


@dataclass
class Config:
    # The trainer's keys are its own: checked against the schema its function declares, when
    # the function is resolved (orchestrator/worker/training_function.py).
    trainer: Any = MISSING
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    run: RunSection = field(default_factory=RunSection)
    log: LogConfig = field(default_factory=LogConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    seed: int = 0
    resume: str = "auto"  # auto | never | a checkpoint URI

    def __post_init__(self) -> None:
        require(self.resume.strip() != "", "resume", self.resume,
                "'auto', 'never' or a checkpoint URI")


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    # The groups cluster/storage/data/... are typed through the fields of Config; only the
    # trainer group, whose schema depends on the choice, registers one schema per trainer.
    cs.store(name="config_schema", node=Config)
    from orchestrator.sweep.config import register_sweeper

    register_sweeper(cs)
