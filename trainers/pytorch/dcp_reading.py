"""Reading a sharded (DCP) checkpoint as data only: it may come from someone else.

torch.distributed.checkpoint's FileSystemReader unpickles ``.metadata`` with plain pickle,
and its DefaultLoadPlanner loads the non-tensor values (optimizer settings, counters) with
``torch.load(weights_only=False)``: a checkpoint folder written by anyone else would run their
code on every worker. Here the metadata goes through an unpickler that builds only DCP's
metadata classes and a few plain types, the values through ``weights_only=True``, and the
shard files a metadata names must lie inside the checkpoint folder. DCP's tensors are already
read with ``weights_only=True`` (tests/test_dcp_reading.py holds it to that).
"""

from __future__ import annotations

import builtins
import collections
import io
import pathlib
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from orchestrator.checkpoint.names import unsafe_reason


class UntrustedCheckpoint(pickle.UnpicklingError):
    """A checkpoint that holds more than data (code, or a path out of its folder)."""


def _metadata_classes() -> dict[tuple[str, str], Any]:
    """Every class DCP defines for its metadata (dataclasses and enums: data, not code)."""
    name = dcp_metadata.__name__
    return {(name, attr): obj for attr, obj in vars(dcp_metadata).items()
            if isinstance(obj, type) and obj.__module__ == name}


ALLOWED: dict[tuple[str, str], Any] = {
    **_metadata_classes(),
    (dcp_filesystem.__name__, "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # by name only
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PosixPath,  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    **{("builtins", n): getattr(builtins, n) for n in ("set", "frozenset", "bytearray", "complex")},
}


class MetadataUnpickler(pickle.Unpickler):
    """Builds the allowed classes and torch dtypes; anything else is refused unbuilt."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UntrustedCheckpoint(f"{self.where} refers to {module}.{name}, which is not "
                                  "checkpoint metadata: refused, nothing in it was run")

    def persistent_load(self, pid: Any) -> Any:
        raise UntrustedCheckpoint(f"{self.where} holds a persistent reference: refused")


def read_metadata_file(path: Path) -> Metadata:
    """A DCP ``.metadata`` file, unpickled as data, its shard files checked to stay inside."""
    with open(path, "rb") as f:
        metadata = MetadataUnpickler(f, str(path)).load()
    if not isinstance(metadata, Metadata):
        raise UntrustedCheckpoint(f"{path} is not DCP metadata ({type(metadata).__name__})")
    for info in (metadata.storage_data or {}).values():
        why = unsafe_reason(getattr(info, "relative_path", None))
        if why is not None:
            raise UntrustedCheckpoint(f"{path} names the shard file "
                                      f"{getattr(info, 'relative_path', None)!r}: {why}")
    return metadata


class DataOnlyReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata read by ``read_metadata_file``. ``fetch(names)``,
    if given, is asked for the shard files this rank's plan reads before they are read: at
    any world size a rank fetches only the shards that hold its part of the state."""

    def __init__(self, path: Path, fetch: Callable[[list[str]], Any] | None = None) -> None:
        super().__init__(path)
        self.fetch = fetch

    def read_data(self, plan: Any, planner: Any) -> Any:
        if self.fetch is not None:
            self.fetch(sorted({self.storage_data[item.storage_index].relative_path
                               for item in plan.items}))
        return super().read_data(plan, planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # DCP's name for a rank's own metadata, as its reader has it
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = read_metadata_file(Path(self.path) / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class DataOnlyPlanner(DefaultLoadPlanner):
    """DCP's planner, the non-tensor values loaded as data."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        data = torch.load(value, weights_only=True)  # refuses code before running any
        clean = io.BytesIO()
        torch.save(data, clean)  # what the parent unpickles is then only what we wrote
        clean.seek(0)
        super().load_bytes(read_item, clean)


def load_sharded(state: dict, folder: Path, fetch: Callable[[list[str]], Any] | None = None,
                 **kwargs: Any) -> None:
    """``dcp.load`` of ``folder`` into ``state``, reading it as data only; a refusal raises
    UntrustedCheckpoint (DCP wraps what its reader raises into a CheckpointException).
    ``fetch``: see DataOnlyReader."""
    if (folder / ".metadata").is_file():
        read_metadata_file(folder / ".metadata")  # refused here as itself, with its reason
    try:
        dcp.load(state, storage_reader=DataOnlyReader(folder, fetch), planner=DataOnlyPlanner(),
                 **kwargs)
    except CheckpointException as exc:
        refused = [e for e, _ in exc.failures.values() if isinstance(e, pickle.UnpicklingError)]
        if not refused:
            raise
        lines = str(refused[0]).strip().splitlines() or [type(refused[0]).__name__]
        # torch's weights-only refusal opens with advice to load it anyway; its cause is below.
        reason = next((ln for ln in lines if "Unpickler error" in ln), lines[0]).strip()
        raise UntrustedCheckpoint(f"{folder} holds more than data: refused, nothing in it was "
                                  f"run ({reason[:300]})") from None
