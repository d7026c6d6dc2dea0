"""A NaN or infinite training loss stops the run, naming the step where it first appeared:
from there every weight turns NaN, and the run would otherwise train to the end, checkpoint
NaN weights and report success. trainer.allow_nonfinite_loss=true lets it go on."""

from __future__ import annotations

import math

import torch

from trainers.neural import NonFiniteLoss, stop_message


class LossWatch:
    """Sees each step's loss. On the CPU it reads the loss at once (no device to wait for);
    on an accelerator it keeps the first bad step on the device, with no sync in the loop,
    and ``check()`` reads it where the loop waits anyway (a checkpoint, an evaluation)."""

    def __init__(self, allowed: bool, device: torch.device):
        self.allowed, self.eager = allowed, device.type == "cpu"
        self._first: torch.Tensor | None = None  # the first bad step, or -1
        self._value: torch.Tensor | None = None  # its loss

    def see(self, step: int, loss: torch.Tensor | float) -> None:
        if self.allowed:
            return
        if self.eager:
            value = float(loss)
            if not math.isfinite(value):
                raise NonFiniteLoss(stop_message(step, value))
            return
        loss = loss.detach().float().reshape(())
        new = ~torch.isfinite(loss)
        if self._first is None:
            self._first = torch.where(new, step, -1)
            self._value = loss
            return
        new = new & (self._first < 0)
        self._first = torch.where(new, step, self._first)
        self._value = torch.where(new, loss, self._value)

    def check(self) -> None:
        if self._first is not None and (step := int(self._first)) >= 0:
            raise NonFiniteLoss(stop_message(step, float(self._value)))
