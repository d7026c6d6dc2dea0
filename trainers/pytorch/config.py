"""The PyTorch trainer's config; no torch import, so the driver can validate it cheaply."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.config.rules import require
from orchestrator.config.schema import TrainerConfig

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
        for key in ("model", "optimizer"):
            require(given(getattr(self, key)), f"trainer.{key}._target_", None,
                    "the import path of a class or function")
        for metric in self.metrics or []:
            ok = metric in METRICS or (isinstance(metric, dict) and "_target_" in metric)
            require(ok, "trainer.metrics", metric,
                    "a list of " + ", ".join(METRICS) + " or {_target_: your fn(output, target)}")
