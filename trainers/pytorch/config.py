"""The PyTorch trainer's config; no torch import, so the driver can validate it cheaply."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.config.rules import require
from orchestrator.config.schema import TrainerConfig
from orchestrator.errors import ConfigError

PRECISIONS = ("32", "bf16-mixed", "fp16-mixed")


class NotFound(ImportError):
    """An import path that names nothing: its message says which part is missing."""


def locate(path: str):
    """The object at a dotted import path (module.Class, module.Class.method). Not Hydra's
    locator: for a class missing from a module that exists it says "No module named
    'pkg.models.MLPP'; 'pkg.models' is not a package"; this says what is missing."""
    import importlib
    from types import ModuleType

    parts = path.split(".") if isinstance(path, str) else []
    if not all(parts) or not parts:
        raise NotFound(f"{path!r} is not an import path such as mypkg.models.Net")
    missing: ModuleNotFoundError | None = None
    for i in range(len(parts), 0, -1):  # the longest prefix that is a module
        name = ".".join(parts[:i])
        try:
            found = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (name == exc.name or name.startswith(exc.name + ".")):
                raise  # the module exists but imports one that does not: the user's to fix
            missing = missing or exc
            continue
        for j in range(i, len(parts)):
            if not hasattr(found, parts[j]):
                owner = ".".join(parts[:j])
                if isinstance(found, ModuleType) and j + 1 < len(parts):  # meant as a module
                    raise NotFound(f"No module named '{owner}.{parts[j]}'")
                kind = "module " if isinstance(found, ModuleType) else ""
                raise NotFound(f"{kind}{owner!r} has no attribute {parts[j]!r}")
            found = getattr(found, parts[j])
        return found
    raise NotFound(f"No module named {parts[0]!r}") from missing


def given(node: dict | None) -> bool:
    """An optional part is given when its node names a _target_ (``_target_: null``: the default)."""
    return bool(node) and node.get("_target_") is not None
PARALLEL = ("ddp", "fsdp")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
TENSOR_STYLES = ("colwise", "rowwise")
METRICS = ("accuracy", "loss", "perplexity", "mse", "r2")


@dataclass
class FSDPConfig:
    """trainer.parallel=fsdp: what is sharded and how (torch.distributed.fsdp.fully_shard)."""

    # Module class names sharded as units (each gathers its parameters only while it runs);
    # empty: every nn.TransformerEncoderLayer/DecoderLayer and every class named *Block.
    blocks: list[str] = field(default_factory=list)
    reshard_after_forward: bool = True  # free gathered parameters after forward (less memory)
    cpu_offload: bool = False  # keep parameters and optimizer state in CPU memory (GPU runs)
    # Build the model on the meta device, shard it, then initialise only this rank's shards
    # (every module's reset_parameters(), seeded per rank): for models that do not fit one
    # worker whole. Parameters a module creates without reset_parameters are not initialised,
    # nor are buffers it fills in __init__ (a causal mask, rotary frequencies).
    meta_init: bool = False
    # A periodic checkpoint blocks the step only while this rank's shards are copied in memory
    # (the copy, 0.75x the sharded state with Adam, is freed once written to disk in the
    # background); false: the step waits for the write to disk, and no copy is made. The
    # last checkpoint and a preemption's are always written directly (nothing to overlap).
    async_save: bool = True


@dataclass
class PipelineConfig:
    """trainer.pipeline: the model cut into ``degree`` stages on different workers, run over
    micro-batches (torch.distributed.pipelining); trainers/pytorch/mesh.py."""

    degree: int = 1  # pipeline stages (SageMaker's pipeline_parallel_degree); 1: no pipeline
    # Layer names where a stage starts (e.g. [blocks.4]); empty: the blocks cut evenly
    split_at: list[str] = field(default_factory=list)
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b (2 stages a worker; nccl only)
    microbatches: int = 4  # each replica's batch cut into this many pipeline micro-batches

    def check(self) -> None:
        require(self.degree >= 1, "trainer.pipeline.degree", self.degree, "an integer >= 1")
        require(self.schedule in SCHEDULES, "trainer.pipeline.schedule", self.schedule,
                "one of " + ", ".join(SCHEDULES))
        require(self.microbatches >= 1, "trainer.pipeline.microbatches", self.microbatches,
                "an integer >= 1")
        require(all(isinstance(n, str) and n for n in self.split_at), "trainer.pipeline.split_at",
                self.split_at, "a list of layer names (e.g. [blocks.4])")


@dataclass
class TensorConfig:
    """trainer.tensor: single layers split over ``degree`` workers (DTensor's
    parallelize_module): a Linear's output columns (colwise) or input rows (rowwise)."""

    degree: int = 1  # tensor-parallel degree; 1: none
    # {module name or pattern (blocks.*.attn.q): colwise | rowwise}; null: the model's
    # tensor_plan() method
    plan: dict[str, str] | None = None

    def check(self) -> None:
        require(self.degree >= 1, "trainer.tensor.degree", self.degree, "an integer >= 1")
        for name, style in (self.plan or {}).items():
            require(style in TENSOR_STYLES, f"trainer.tensor.plan.{name}", style,
                    "colwise or rowwise")


@dataclass
class PyTorchConfig(TrainerConfig):
    name: str = "ddp"
    fn: str = "trainers.pytorch.train:main"
    backend: str = "torch"
    parallel: str = "ddp"  # ddp: replicate the model | fsdp: shard it over the workers
    model: dict[str, Any] = field(default_factory=lambda: {"_target_": "trainers.pytorch.models.MLP"})
    loss: dict[str, Any] | None = None  # _target_ null: from data.task
    step_fn: dict[str, Any] | None = None  # (model, batch) -> loss | (loss, {metric: value})
    lr: float = 0.1  # the optimizer's lr by default (optimizer.lr: ${..lr}), handy to sweep
    optimizer: dict[str, Any] = field(default_factory=lambda: {
        "_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1, "momentum": 0.9})
    scheduler: dict[str, Any] | None = None  # built with _partial_ on the optimizer
    metrics: list[Any] | None = None  # null: from data.task; names or {_target_: fn(output, target)}
    batch_size: int = 64  # the global batch, whatever the number of workers
    micro_batch_size: int | None = None  # at most this many rows per forward; accumulation does the rest
    precision: str = "32"
    grad_clip: float | None = None  # max gradient norm
    # DDP: parameters a step may leave without a gradient (a head used on some steps only);
    # DDP then finds them at every step (slower), instead of failing at the second.
    find_unused_parameters: bool = False
    # A NaN or inf training loss stops the run with one line naming the step (every later step
    # would be NaN too); true: train on regardless.
    allow_nonfinite_loss: bool = False
    epochs: int = 10
    max_steps: int | None = None  # stop earlier than epochs * steps_per_epoch
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    tensor: TensorConfig = field(default_factory=TensorConfig)
    # Return freed tensor memory of 1 MiB blocks and more to the OS at once (lower, flat peak
    # host memory; ~30% slower steps on CPU). null: on for parallel=fsdp on CPU, else off.
    release_host_memory: bool | None = None

    def __post_init__(self) -> None:
        require(self.parallel in PARALLEL, "trainer.parallel", self.parallel, "one of ddp, fsdp")
        require(self.precision in PRECISIONS, "trainer.precision", self.precision,
                "one of " + ", ".join(PRECISIONS))
        require(self.batch_size >= 1, "trainer.batch_size", self.batch_size, "an integer >= 1")
        if self.micro_batch_size is not None:
            require(self.micro_batch_size >= 1, "trainer.micro_batch_size", self.micro_batch_size,
                    "null (the whole share at once) or an integer >= 1")
        if self.grad_clip is not None:
            require(self.grad_clip > 0, "trainer.grad_clip", self.grad_clip, "null or a number > 0")
        require(self.lr > 0, "trainer.lr", self.lr, "a number > 0")
        require(self.epochs >= 1, "trainer.epochs", self.epochs, "an integer >= 1")
        if self.max_steps is not None:
            require(self.max_steps >= 1, "trainer.max_steps", self.max_steps, "null or an integer >= 1")
        self.pipeline.check()
        self.tensor.check()
        for key in ("model", "optimizer"):
            require(given(getattr(self, key)), f"trainer.{key}._target_", None,
                    "the import path of a class or function")
        for metric in self.metrics or []:
            ok = metric in METRICS or (isinstance(metric, dict) and "_target_" in metric)
            require(ok, "trainer.metrics", metric,
                    "a list of " + ", ".join(METRICS) + " or {_target_: your fn(output, target)}")


def check_world(trainer: dict, cluster: dict, given: set) -> dict:
    """trainer.pipeline.degree x trainer.tensor.degree against the worker counts, and each
    replica's batch against the pipeline's micro-batches (the cluster hook of the training
    function: before the config is typed, without torch). Sets cluster.workers_multiple_of:
    an elastic job shrinks and grows by whole model copies."""
    pipeline, tensor = trainer.get("pipeline") or {}, trainer.get("tensor") or {}
    p, t = int(pipeline.get("degree") or 1), int(tensor.get("degree") or 1)
    if p * t == 1:
        return {}
    sizes = {"cluster.workers": cluster.get("workers")}
    if cluster.get("min_workers") is not None:
        sizes["cluster.min_workers"] = cluster["min_workers"]
    for key, n in sizes.items():
        if not isinstance(n, int) or n < 1:
            continue  # the schema says what is wrong with it
        require(n % (p * t) == 0, key, n, f"a multiple of trainer.pipeline.degree={p} x "
                f"trainer.tensor.degree={t} ({p * t}): the workers are laid out as stages x "
                "tensor shards x data-parallel replicas")
        m, batch = int(pipeline.get("microbatches") or 1), int(trainer.get("batch_size") or 1)
        d = n // (p * t)
        if p > 1 and batch % (d * m):
            raise ConfigError(
                f"trainer.pipeline.microbatches={m} does not divide each replica's batch: "
                f"trainer.batch_size={batch} over {d} data-parallel replica{'s' if d > 1 else ''} "
                f"({key}={n} / {p * t}) is {batch / d:g} rows; a trainer.batch_size that is a "
                f"multiple of {d * m}")
    return {"workers_multiple_of": p * t}
