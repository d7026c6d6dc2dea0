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
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from trainers.pytorch.precision import Precision


class OtherParallelMode(ValueError):
    """A checkpoint of the other trainer.parallel: every restart would meet it again."""

    retry = False


@contextmanager
def plain_errors():
    """DCP raises CheckpointException, a BaseException: past every `except Exception` (the
    worker's error report, the upload thread's), it ended them unreported. A RuntimeError
    with its first rank's failure instead."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        raise RuntimeError(first_failure(exc)) from exc


def first_failure(exc) -> str:
    failures = getattr(exc, "failures", None) or {}
    for rank, (error, _traceback) in sorted(failures.items()):
        text = (str(error).strip().splitlines() or [""])[0]
        return f"torch.distributed.checkpoint on rank {rank}: {type(error).__name__}: {text}"
    return (str(exc).strip().splitlines() or ["CheckpointException"])[0]


def plain_future(future: Future) -> Future:
    """async_save's future, its CheckpointException a RuntimeError (plain_errors)."""
    plain: Future = Future()

    def done(finished: Future) -> None:
        try:
            plain.set_result(finished.result())
        except BaseException as exc:  # noqa: BLE001  (a CheckpointException is one)
            plain.set_exception(RuntimeError(first_failure(exc)) if not isinstance(
                exc, Exception) else exc)

    future.add_done_callback(done)
    return plain


class TrainingState:
    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                 precision: Precision, rank: int, sharded: bool, flat_optimizer: bool = False):
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        self.precision, self.rank, self.sharded = precision, rank, sharded
        # Optimizer settings kept per parameter name (param_groups.<name>.lr), not per group:
        # pipeline stages hold different parameters in their one group, and a group's list of
        # names, the same key on every stage, would be saved from one stage only.
        self.flat_optimizer = flat_optimizer
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
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        if self._writing is not None:  # one save's collectives at a time on the group
            wait([self._writing])  # its failure is the committer's to report
            self._writing = None
        model, optimizer = get_state_dict(self.module, self.optimizer,
                                          options=StateDictOptions(
                                              flatten_optimizer_state_dict=self.flat_optimizer))
        state = {"model": model, "optimizer": optimizer}
        # No fsync: the folder is only staging for the upload.
        writer = dcp.FileSystemWriter(folder / "dcp", sync_files=False)
        if not background:
            with plain_errors():
                dcp.save(state, storage_writer=writer)
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")  # DCP's collectives are CPU objects
        self._writing = plain_future(dcp.async_save(state, storage_writer=writer,
                                                    process_group=self._group))
        return self._writing

    def files(self) -> list[str]:
        """What ``load`` reads first (ctx.restore's files): DDP's replicated state, or DCP's
        metadata, from which the shards this rank's part lies in are chosen (``fetch``)."""
        return ["training_state.pt", "dcp/*.metadata",
                *([] if self.sharded else ["model.pt", "optimizer.pt"])]

    def load(self, folder: Path, device: torch.device,
             fetch: Callable[[list[str]], object] | None = None) -> None:
        """``fetch(names)`` (ctx.restore) is asked for the other files the load needs."""
        if self.sharded or (not (folder / "model.pt").is_file() and (folder / "dcp").is_dir()):
            # DDP from sharded state too: a pipeline or tensor parallel run resumed at
            # pipeline and tensor degree 1 (DCP gathers the whole model on each rank)
            self._load_shards(folder, fetch)
        else:
            if not (folder / "model.pt").is_file():
                raise OtherParallelMode(f"{folder} holds no model.pt: it was written by "
                                        "trainer.parallel=fsdp; resume it with the same "
                                        "parallel mode")
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
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
            set_state_dict,
        )

        from trainers.pytorch.dcp_reading import load_sharded, read_metadata_file

        if not (folder / "dcp").is_dir():
            raise OtherParallelMode(f"{folder} holds no sharded state (dcp/): it was written by "
                                    "trainer.parallel=ddp; resume it with the same parallel mode")
        saved = read_metadata_file(folder / "dcp" / ".metadata").state_dict_metadata
        # Written flat (a pipeline's: settings per parameter) or by groups (FSDP's), read so.
        flat = StateDictOptions(flatten_optimizer_state_dict=not any(
            key.startswith("optimizer.param_groups.") and key.endswith(".params") for key in saved))
        model, optimizer = get_state_dict(self.module, self.optimizer, options=flat)
        state = {"model": model, "optimizer": optimizer}
        # A parameter that never had a gradient (a head the forward does not call) has no
        # optimizer state in the checkpoint, but the fresh optimizer's state dict lists it:
        # asked for, DCP would refuse the whole load. It starts with no state, as it trained.
        if flat.flatten_optimizer_state_dict:
            unsaved = [key for key in state["optimizer"] if f"optimizer.{key}" not in saved]
            never_stepped = sorted({key.split(".", 1)[1].rsplit(".", 1)[0] for key in unsaved
                                    if key.startswith("state.")})
            for key in unsaved:
                del state["optimizer"][key]
        else:
            never_stepped = [name for name in state["optimizer"].get("state", {})
                             if not any(key.startswith(f"optimizer.state.{name}.") for key in saved)]
            for name in never_stepped:
                del state["optimizer"]["state"][name]
        # This rank's shards, at any world size; read as data only (the folder may be anyone's).
        with plain_errors():
            load_sharded(state, folder / "dcp",
                         fetch and (lambda names: fetch([f"dcp/{name}" for name in names])))
        # strict=False only for those: DCP's load has already refused any other missing key
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"],
                       options=StateDictOptions(
                           strict=not never_stepped,
                           flatten_optimizer_state_dict=flat.flatten_optimizer_state_dict))
        parameters = dict(self.module.named_parameters())
        for name in never_stepped:
            self.optimizer.state.pop(parameters.get(name), None)
