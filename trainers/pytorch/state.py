"""What a checkpoint of the PyTorch trainer holds, and who writes it.

DDP replicates the state: rank 0 writes model.pt (the plain module's state dict, loadable
without the orchestrator), optimizer.pt and, when there are any, the scheduler's and the
gradient scaler's states.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from trainers.pytorch.precision import Precision


class TrainingState:
    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                 precision: Precision, rank: int):
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        self.precision, self.rank = precision, rank

    def _extras(self) -> dict:
        extras = {}
        if self.scheduler is not None:
            extras["scheduler"] = self.scheduler.state_dict()
        if self.precision.scaler.is_enabled():
            extras["scaler"] = self.precision.scaler.state_dict()
        return extras

    def write(self, folder: Path) -> None:
        if self.rank != 0:
            return
        torch.save(self.module.state_dict(), folder / "model.pt")
        torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")
        if extras := self._extras():
            torch.save(extras, folder / "training_state.pt")

    def load(self, folder: Path, device: torch.device) -> None:
        self.module.load_state_dict(torch.load(folder / "model.pt", map_location=device,
                                               weights_only=True))
        self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location=device,
                                                  weights_only=True))
        if (folder / "training_state.pt").exists():
            extras = torch.load(folder / "training_state.pt", map_location=device, weights_only=True)
            if self.scheduler is not None and "scheduler" in extras:
                self.scheduler.load_state_dict(extras["scheduler"])
            if "scaler" in extras:
                self.precision.scaler.load_state_dict(extras["scaler"])
