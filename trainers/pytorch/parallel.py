"""trainer.parallel: how the model is spread over the workers.

ddp replicates it and averages gradients once a step. fsdp (FSDP2, fully_shard) shards
parameters, gradients and optimizer state over the workers: each block named in
trainer.fsdp.blocks (default: transformer blocks) gathers its parameters only while it runs,
and gradients are reduce-scattered. Gradient accumulation skips the average (DDP) or the
reduce-scatter (FSDP) until a step's last micro-batch.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainers.pytorch.precision import DTYPES

DEFAULT_BLOCKS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def blocks(module: nn.Module, names: list[str]) -> list[nn.Module]:
    """The submodules sharded as units: the classes named, else transformer blocks (torch's
    encoder/decoder layers, and any class whose name ends in Block)."""
    def chosen(m: nn.Module) -> bool:
        if names:
            return type(m).__name__ in names
        return isinstance(m, DEFAULT_BLOCKS) or type(m).__name__.endswith("Block")

    return [m for m in module.modules() if m is not module and chosen(m)]


def shard(module: nn.Module, fsdp: dict, precision: str, mesh=None, summed: bool = False) -> nn.Module:
    """``mesh``: the data-parallel axis of a device mesh (pipeline or tensor parallel runs);
    ``summed``: gradients added over the replicas, not averaged (their loss already weighs
    each micro-batch by its rows out of the global batch's)."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    dtype = DTYPES.get(precision)
    # Mixed precision the FSDP way: parameters gathered in the low precision, gradients
    # reduced and the model's output returned in fp32.
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                  output_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    options = {"mp_policy": policy, "reshard_after_forward": fsdp.get("reshard_after_forward", True),
               # pinned host memory needs an accelerator: not pinned on a CPU-only worker
               "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
               if fsdp.get("cpu_offload") else OffloadPolicy()}
    if mesh is not None:
        options["mesh"] = mesh
    # Innermost first: FSDP2 cannot shard a block inside one it has already sharded
    # (a ResBlock holding an MLPBlock).
    units = [*reversed(blocks(module, list(fsdp.get("blocks") or []))), module]
    for unit in units:
        fully_shard(unit, **options)
        if summed:  # a plain sum: gloo has no pre-multiplied sum
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    return module


def parallelize(module: nn.Module, tcfg: dict, world_size: int, device: torch.device) -> nn.Module:
    if tcfg.get("parallel") == "fsdp":
        return shard(module, tcfg.get("fsdp") or {}, tcfg.get("precision", "32"))
    if world_size == 1:
        return module
    return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None,
                                   find_unused_parameters=bool(tcfg.get("find_unused_parameters")))


def materialize(module: nn.Module, device: torch.device, seed: int) -> None:
    """trainer.fsdp.meta_init: allocate this rank's shards and initialise them. Seeded per
    rank: the same seed everywhere would give every shard of a weight the same values."""
    module.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        # Children first, as their parents' __init__ ran after theirs: nn.MultiheadAttention's
        # own reset (its only one is private) then zeroes its out_proj's bias, as torch does.
        for sub in reversed(list(module.modules())):
            reset = getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)
            if callable(reset):
                reset()


@contextmanager
def no_sync(model: nn.Module):
    """Accumulate this micro-batch's gradients locally (no all-reduce or reduce-scatter yet)."""
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield
