"""What a checkpoint of the PyTorch trainer holds, and who writes it.

DDP replicates the state: rank 0 writes model.pt (the plain module's state dict, loadable
without the orchestrator) and optimizer.pt. FSDP shards it: every rank writes its own shards
of the model and optimizer state with torch.distributed.checkpoint (DCP) into dcp/ (rank 0
adds DCP's .metadata): nothing is gathered on one rank, and a checkpoint written at one world
size loads at another (DCP reshards). The scheduler's and gradient scaler's states, the same
on every rank, are rank 0's training_state.pt in both. Every file is read as data, never as
pickled code (``weights_only=True``; DCP through trainers/pytorch/dcp_reading.py).

In the background (trainer.fsdp.async_save, periodic checkpoints), the FSDP step waits only
for a copy of this rank's shards in memory (DCP's async_save): the files are written from that
copy in a background thread, whose collectives (planning, the metadata) run on a process
group of their own so they never interleave with the training's. The copy costs memory, 0.75x
the sharded state with Adam (parameters and both moments), until the files are written.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, wait
from pathlib import Path

import torch
from torch import nn

from trainers.pytorch.precision import Precision


class TrainingState:
    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                 precision: Precision, rank: int, sharded: bool):
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        self.precision, self.rank, self.sharded = precision, rank, sharded
        self._writing: Future | None = None  # the previous sharded save, still being written
        self._group = None  # the sharded saves' own process group, made at the first one

    def _extras(self) -> dict:
        extras = {}
        if self.scheduler is not None:
            extras["scheduler"] = self.scheduler.state_dict()
        if self.precision.scaler.is_enabled():
            extras["scaler"] = self.precision.scaler.state_dict()
        return extras

    def write(self, folder: Path, background: bool = False) -> Future | None:
        """This rank's files into ``folder``; sharded and in the background, a future that
        finishes them."""
        if self.rank == 0 and (extras := self._extras()):
            torch.save(extras, folder / "training_state.pt")
        if self.sharded:  # collective: every rank writes its shards
            return self._write_shards(folder, background)
        if self.rank == 0:
            torch.save(self.module.state_dict(), folder / "model.pt")
            torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")
        return None

    def _write_shards(self, folder: Path, background: bool) -> Future | None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self._writing is not None:  # one save's collectives at a time on the group
            wait([self._writing])  # its failure is the committer's to report
            self._writing = None
        model, optimizer = get_state_dict(self.module, self.optimizer)
        state = {"model": model, "optimizer": optimizer}
        # No fsync: the folder is only staging for the upload.
        writer = dcp.FileSystemWriter(folder / "dcp", sync_files=False)
        if not background:
            dcp.save(state, storage_writer=writer)
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")  # DCP's collectives are CPU objects
        self._writing = dcp.async_save(state, storage_writer=writer, process_group=self._group)
        return self._writing

    def files(self) -> list[str]:
        """What ``load`` reads first (ctx.restore's files): DDP's replicated state, or DCP's
        metadata, from which the shards this rank's part lies in are chosen (``fetch``)."""
        return ["training_state.pt", *(["dcp/*.metadata"] if self.sharded
                                       else ["model.pt", "optimizer.pt"])]

    def load(self, folder: Path, device: torch.device,
             fetch: Callable[[list[str]], object] | None = None) -> None:
        """``fetch(names)`` (ctx.restore) is asked for the other files the load needs."""
        if self.sharded:
            self._load_shards(folder, fetch)
        else:
            self.module.load_state_dict(torch.load(folder / "model.pt", map_location=device,
                                                   weights_only=True))
            self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt",
                                                      map_location=device, weights_only=True))
        if (folder / "training_state.pt").exists():
            extras = torch.load(folder / "training_state.pt", map_location=device, weights_only=True)
            if self.scheduler is not None and "scheduler" in extras:
                self.scheduler.load_state_dict(extras["scheduler"])
            if "scaler" in extras:
                self.precision.scaler.load_state_dict(extras["scaler"])

    def _load_shards(self, folder: Path, fetch: Callable[[list[str]], object] | None) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from trainers.pytorch.dcp_reading import load_sharded

        if not (folder / "dcp").is_dir():
            raise ValueError(f"{folder} holds no sharded state (dcp/): it was written by "
                             "trainer.parallel=ddp; resume it with the same parallel mode")
        model, optimizer = get_state_dict(self.module, self.optimizer)
        state = {"model": model, "optimizer": optimizer}
        # This rank's shards, at any world size; read as data only (the folder may be anyone's).
        load_sharded(state, folder / "dcp",
                     fetch and (lambda names: fetch([f"dcp/{name}" for name in names])))
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
