"""Model parallelism on a device mesh: trainer.pipeline.degree (P) stages, trainer.tensor.degree
(T) ways of splitting single layers, and data parallelism (D) over what is left: world = P x T
x D, mesh axes (pp, dp, tp), tp innermost (its collectives run every layer, between
neighbouring ranks).

Stages are cut from a model built on the meta device, so that no worker ever holds the whole
model: a stage keeps its layers under their own names (``blocks.3.attn.q.weight`` whatever
the stage or the degree), so that checkpoints (DCP, keyed by those names) load at any other
P, T or D. A model says how its forward runs as a chain of layers: an nn.Sequential's
children, or the names its ``pipeline_layers()`` method lists; its tensor plan comes from
``tensor_plan()`` or trainer.tensor.plan.

Everything here that judges a config runs on the meta device without a process group: the
driver's trial (trainers/pytorch/check.py) refuses bad degrees, split points and plans in
one line before Ray starts.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import torch
from torch import nn

from orchestrator.errors import ConfigError
from trainers.pytorch.parallel import blocks


class MeshRefused(ValueError):
    """A world the mesh cannot be laid on: every restart would meet it again."""

    retry = False


@dataclass(frozen=True)
class Degrees:
    pipeline: int
    tensor: int
    data: int

    @property
    def model_parallel(self) -> bool:
        return self.pipeline > 1 or self.tensor > 1


def degrees(tcfg: dict, world_size: int) -> Degrees:
    """(P, T, D) for a world of ``world_size`` workers."""
    p = int((tcfg.get("pipeline") or {}).get("degree") or 1)
    t = int((tcfg.get("tensor") or {}).get("degree") or 1)
    if world_size % (p * t):
        raise MeshRefused(
            f"{world_size} workers cannot be laid out as trainer.pipeline.degree={p} x "
            f"trainer.tensor.degree={t} x data-parallel replicas: the world must be a multiple "
            f"of {p * t}")
    return Degrees(p, t, world_size // (p * t))


def model_parallel(tcfg: dict) -> bool:
    return int((tcfg.get("pipeline") or {}).get("degree") or 1) > 1 or \
        int((tcfg.get("tensor") or {}).get("degree") or 1) > 1


# -- the chain of layers, and the stages cut from it -----------------------------------------
def layer_names(model: nn.Module) -> list[str]:
    """The model's forward as a chain of its submodules, by name."""
    listed = getattr(model, "pipeline_layers", None)
    if callable(listed):
        names = [str(n) for n in listed()]
        modules = dict(model.named_modules())
        missing = [n for n in names if n not in modules or not n]
        if missing:
            raise ConfigError(f"trainer.model: its pipeline_layers() names {missing[0]!r}, which is "
                              "no submodule of the model")
        return names
    if isinstance(model, nn.Sequential):
        return [name for name, _ in model.named_children()]
    raise ConfigError(
        f"trainer.model: a {type(model).__name__} cannot be cut into pipeline stages: give it a "
        "pipeline_layers() method listing the submodules its forward runs one after another "
        "(e.g. ['embed', 'blocks.0', 'blocks.1', 'ln', 'head']), or make it an nn.Sequential")


def stage_bounds(model: nn.Module, names: list[str], stages: int, split_at: list[str],
                 block_names: list[str] | None = None) -> list[int]:
    """The index in ``names`` where each stage starts (the first is 0)."""
    split_at = [str(n) for n in split_at]  # [4] for an nn.Sequential's fifth layer
    if split_at:
        unknown = [n for n in split_at if n not in names]
        if unknown:
            raise ConfigError(f"trainer.pipeline.split_at: {unknown[0]!r} is not a layer of the model's "
                              f"chain ({', '.join(names[:6])}{', ...' if len(names) > 6 else ''})")
        if len(split_at) != stages - 1:
            raise ConfigError(f"trainer.pipeline.split_at={split_at}: {stages} stages "
                              f"(trainer.pipeline.degree) need {stages - 1} split points")
        starts = [0, *sorted(names.index(n) for n in split_at)]
        if len(set(starts)) != len(starts):
            raise ConfigError(f"trainer.pipeline.split_at={split_at}: a stage would be empty")
        return starts
    modules = dict(model.named_modules())
    found = {id(m) for m in blocks(model, list(block_names or []))}
    at_blocks = [i for i, n in enumerate(names) if id(modules[n]) in found]
    cut_over = at_blocks if len(at_blocks) >= stages else list(range(len(names)))
    if len(cut_over) < stages:
        raise ConfigError(f"trainer.pipeline.degree={stages}: the model's chain has {len(names)} "
                          f"layers, fewer than the stages")
    return [0] + [cut_over[math.ceil(k * len(cut_over) / stages)] for k in range(1, stages)]


class Stage(nn.Module):
    """Some consecutive layers of a model, under their names in the whole model."""

    def __init__(self, model: nn.Module, names: list[str]):
        super().__init__()
        self.layer_names = list(names)
        for name in names:
            parent = self
            *path, last = name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(last, model.get_submodule(name))

    def forward(self, x):
        for name in self.layer_names:
            x = self.get_submodule(name)(x)
        return x


def cut(model: nn.Module, tcfg: dict, stage: int, stages: int) -> Stage:
    """This stage's layers of ``model`` (built on the meta device)."""
    names = layer_names(model)
    check_layers_cover(model, names)
    starts = stage_bounds(model, names, stages, list((tcfg.get("pipeline") or {}).get("split_at") or []),
                          (tcfg.get("fsdp") or {}).get("blocks"))
    ends = [*starts[1:], len(names)]
    return Stage(model, names[starts[stage]:ends[stage]])


def check_layers_cover(model: nn.Module, names: list[str]) -> None:
    """Every parameter lies in exactly one layer of the chain: a parameter outside it would be
    on no stage; one shared by two layers (tied embeddings) cannot be split between stages."""
    owner: dict[int, str] = {}
    for name in names:
        for pname, p in model.get_submodule(name).named_parameters():
            if id(p) in owner and owner[id(p)] != name:
                raise ConfigError(f"trainer.model: parameter {name}.{pname} is shared with layer "
                                  f"{owner[id(p)]} (tied weights), which pipeline stages cannot split")
            owner[id(p)] = name
    outside = [n for n, p in model.named_parameters() if id(p) not in owner]
    if outside:
        raise ConfigError(f"trainer.model: parameter {outside[0]} is in no layer its "
                          "pipeline_layers() lists: every parameter must belong to one of them")


def layer_names_or_all(model: nn.Module) -> list[str]:
    """The model's chain where it has one covering every parameter, else the model itself
    (the name ''): tensor parallelism alone needs no chain."""
    try:
        names = layer_names(model)
        check_layers_cover(model, names)
        return names
    except ConfigError:
        return [""]


def materialize(module: nn.Module, layers: list[str], device: torch.device, seed: int) -> None:
    """Allocate ``module`` (built on the meta device) and initialise each of its ``layers``
    from a seed of its own (``seed``, the layer's name): the same weights at any P, T or D,
    since a layer's values depend on nothing else. Children are reset before their parents,
    as their constructors ran."""
    module.to_empty(device=device)
    with torch.no_grad():
        for name in layers:
            torch.manual_seed(layer_seed(seed, name))
            for sub in reversed(list(module.get_submodule(name).modules())):
                reset = getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)
                if callable(reset):
                    reset()


def initialized(build, seed: int, device: str = "cpu") -> nn.Module:
    """A whole model with the weights every stage and shard of it starts from (``build()``
    runs on the meta device): what a single-process run must start from to compare."""
    with torch.device("meta"):
        model = build()
    materialize(model, layer_names_or_all(model), torch.device(device), seed)
    return model


def layer_seed(seed: int, name: str) -> int:
    import zlib

    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


# -- tensor parallelism ------------------------------------------------------------------------
def tensor_plan(model: nn.Module, tcfg: dict) -> dict[str, str]:
    """{module name: colwise | rowwise} for every module the plan's names or patterns match."""
    plan = dict((tcfg.get("tensor") or {}).get("plan") or {})
    key = "trainer.tensor.plan"
    if not plan:
        method = getattr(model, "tensor_plan", None)
        if not callable(method):
            raise ConfigError(f"trainer.tensor.degree>1: a {type(model).__name__} has no tensor_plan() "
                              "method: give trainer.tensor.plan={module name or pattern: colwise | "
                              "rowwise} (e.g. '{blocks.*.mlp.0: colwise, blocks.*.mlp.2: rowwise}')")
        plan, key = dict(method()), "trainer.model.tensor_plan()"
    modules = dict(model.named_modules())
    chosen: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in ("colwise", "rowwise"):
            raise ConfigError(f"{key}: {pattern!r}: {style!r} is not colwise or rowwise")
        matched = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise ConfigError(f"{key}: {pattern!r} names no module of the model")
        for name in matched:
            if not isinstance(modules[name], (nn.Linear, nn.Embedding)):
                raise ConfigError(f"{key}: {name} is a {type(modules[name]).__name__}; tensor "
                                  "parallelism splits nn.Linear and nn.Embedding layers")
            chosen[name] = style
    return chosen


def check_tensor_split(model: nn.Module, plan: dict[str, str], t: int) -> None:
    modules = dict(model.named_modules())
    for name, style in plan.items():
        m = modules[name]
        size = (m.out_features if style == "colwise" else m.in_features) if isinstance(m, nn.Linear) \
            else (m.embedding_dim if style == "colwise" else m.num_embeddings)
        if size % t:
            raise ConfigError(f"trainer.tensor.degree={t}: {name} ({style}) has {size} "
                              f"{'outputs' if style == 'colwise' else 'inputs'}, not divisible by {t}")


def parallelize_tensors(stage: nn.Module, plan: dict[str, str], tp_mesh) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    names = {n for n, _ in stage.named_modules()}
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    mine = {name: styles[style]() for name, style in plan.items() if name in names}
    if mine:
        parallelize_module(stage, tp_mesh, mine)


# -- the driver's check ------------------------------------------------------------------------
def check_layout(model: nn.Module, tcfg: dict) -> None:
    """On the meta device, before Ray starts: the stages against the model, the tensor plan
    against its layers (the degrees against the worker counts: trainers/pytorch/config.py's
    check_world, before the config is typed)."""
    pcfg = tcfg.get("pipeline") or {}
    p, t = int(pcfg.get("degree") or 1), int((tcfg.get("tensor") or {}).get("degree") or 1)
    if tcfg.get("precision") == "fp16-mixed":
        raise ConfigError("trainer.precision='fp16-mixed' is not allowed with pipeline or tensor "
                          "parallelism: bf16-mixed or 32")
    if p > 1:
        if tcfg.get("step_fn") and tcfg["step_fn"].get("_target_"):
            raise ConfigError("trainer.step_fn is not allowed with trainer.pipeline.degree>1: the "
                              "last stage computes the loss from the model's output (trainer.loss)")
        if pcfg.get("schedule") == "interleaved_1f1b" and tcfg.get("backend", "torch") in ("torch", "gloo"):
            raise ConfigError("trainer.pipeline.schedule='interleaved_1f1b' is not allowed with gloo "
                              "(CPU workers; it hangs in torch's gloo backend): gpipe or 1f1b, or "
                              "trainer.backend=nccl on GPUs")
        cut(model, tcfg, 0, p * (2 if pcfg.get("schedule") == "interleaved_1f1b" else 1))
    if t > 1:
        check_tensor_split(model, tensor_plan(model, tcfg), t)
