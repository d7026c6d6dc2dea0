"""A sharded (DCP) checkpoint is read as data: pickled code in its metadata, its values or its
tensors is refused without being run, a shard file outside its folder is refused, and a
genuine checkpoint still loads. One process, no process group, no Ray."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from trainers.pytorch.dcp_reading import UntrustedCheckpoint, load_sharded, read_metadata_file
from trainers.pytorch.precision import Precision
from trainers.pytorch.state import TrainingState

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Payload:
    """Unpickled, it creates the file at ``path``: what a hostile checkpoint would run."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def trained_state(seed: int) -> TrainingState:
    torch.manual_seed(seed)
    module = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
    module(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return TrainingState(module, optimizer, None, Precision("32", torch.device("cpu")), rank=0,
                         sharded=True)


def written(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    trained_state(0).write(folder)
    return folder


def test_the_payload_is_real(tmp_path):
    """Plain pickle runs it: what the tests below refuse is a working attack."""
    pickle.loads(pickle.dumps(Payload(tmp_path / "ran"))).close()
    assert (tmp_path / "ran").exists()


def test_a_genuine_sharded_checkpoint_loads(tmp_path):
    folder = written(tmp_path)
    saved, restored = trained_state(0), trained_state(1)
    restored.load(folder, torch.device("cpu"))
    for a, b in zip(saved.module.parameters(), restored.module.parameters(), strict=True):
        assert torch.equal(a, b)
    want, got = saved.optimizer.state_dict(), restored.optimizer.state_dict()
    assert got["param_groups"][0]["lr"] == want["param_groups"][0]["lr"]
    for key in want["state"]:
        assert torch.equal(want["state"][key]["exp_avg"], got["state"][key]["exp_avg"])


@pytest.mark.parametrize("where", ["whole", "nested"])
def test_metadata_carrying_pickled_code_is_refused_unrun(tmp_path, where):
    folder = written(tmp_path)
    metadata_file = folder / "dcp" / ".metadata"
    marker = tmp_path / "owned"
    if where == "whole":
        forged = Payload(marker)
    else:  # genuine metadata with the payload tucked inside
        forged = read_metadata_file(metadata_file)
        forged.planner_data = {"note": Payload(marker)}
    metadata_file.write_bytes(pickle.dumps(forged))
    with pytest.raises(UntrustedCheckpoint, match="not checkpoint metadata"):
        trained_state(1).load(folder, torch.device("cpu"))
    assert not marker.exists()


def test_a_value_carrying_pickled_code_is_refused_unrun(tmp_path):
    """Non-tensor values are saved as pickles: DCP's own planner would run this one."""
    marker, stock_marker = tmp_path / "owned", tmp_path / "stock-planner-ran"
    dcp.save({"w": torch.ones(2), "note": Payload(marker)},
             storage_writer=dcp.FileSystemWriter(tmp_path / "values"))
    with pytest.raises(UntrustedCheckpoint, match="nothing in it was run"):
        load_sharded({"w": torch.zeros(2), "note": 0}, tmp_path / "values")
    assert not marker.exists()
    dcp.save({"w": torch.ones(2), "note": Payload(stock_marker)},
             storage_writer=dcp.FileSystemWriter(tmp_path / "stock"))
    dcp.load({"w": torch.zeros(2), "note": 0}, checkpoint_id=tmp_path / "stock")
    assert stock_marker.exists()  # the reason for DataOnlyPlanner


def test_a_tensor_carrying_pickled_code_is_refused_unrun(tmp_path):
    """The tensor bytes are read by DCP with weights_only=True; held to it here."""
    folder, marker = tmp_path / "tensor", tmp_path / "owned"
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(folder))
    metadata = read_metadata_file(folder / ".metadata")
    (info,) = metadata.storage_data.values()
    shard = folder / info.relative_path
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    info.offset, info.length = shard.stat().st_size, len(payload.getvalue())
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UntrustedCheckpoint, match="nothing in it was run"):
        load_sharded({"w": torch.zeros(2)}, folder)
    assert not marker.exists()


def test_a_shard_file_outside_the_folder_is_refused(tmp_path):
    folder = tmp_path / "escape"
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(folder))
    metadata = read_metadata_file(folder / ".metadata")
    for info in metadata.storage_data.values():
        info.relative_path = "../../secret.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UntrustedCheckpoint, match=r"'\.\./\.\./secret\.distcp'"):
        load_sharded({"w": torch.zeros(2)}, folder)
