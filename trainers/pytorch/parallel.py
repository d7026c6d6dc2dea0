"""trainer.parallel: how the model is spread over the workers. ddp replicates it and averages
gradients; gradient accumulation skips that average until a step's last micro-batch."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def parallelize(module: nn.Module, tcfg: dict, world_size: int, device: torch.device) -> nn.Module:
    if world_size == 1:
        return module
    return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)


@contextmanager
def no_sync(model: nn.Module):
    """Accumulate this micro-batch's gradients locally (no all-reduce yet)."""
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield
