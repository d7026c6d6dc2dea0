"""trainer.precision: autocast for the forward pass; a gradient scaler for fp16 (its state is
part of the checkpoint); gradient clipping on unscaled gradients."""

from __future__ import annotations

from contextlib import nullcontext

import torch

DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


class Precision:
    def __init__(self, mode: str, device: torch.device, autocast: bool = True):
        # FSDP casts by its own mixed-precision policy (trainers/pytorch/parallel.py) instead.
        self.dtype = DTYPES.get(mode) if autocast else None
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type, enabled=mode == "fp16-mixed")

    def autocast(self):
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, parameters, grad_clip: float | None) -> None:
        if grad_clip:
            self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
        self.scaler.step(optimizer)  # with fp16: skipped when a gradient overflowed
        self.scaler.update()
