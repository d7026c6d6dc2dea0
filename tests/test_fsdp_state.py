"""The FSDP path's state on one in-process rank (gloo, world size 1): what a user's model
meets when it is sharded, saved and resumed. Found by a review trying models people bring."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from orchestrator.errors import ConfigError
from trainers.pytorch.parallel import blocks, materialize, shard
from trainers.pytorch.precision import Precision
from trainers.pytorch.state import OtherParallelMode, TrainingState


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    import torch.distributed as dist

    from tests.conftest import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


class WithPooler(nn.Module):
    """A Hugging Face encoder's shape: a pooler the classification forward never calls."""

    def __init__(self):
        super().__init__()
        self.body, self.pooler, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


class ResBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = MLPBlock()

    def forward(self, x):
        return x + self.inner(x)


def sharded(model: nn.Module, **fsdp) -> tuple[nn.Module, torch.optim.Optimizer, TrainingState]:
    model = shard(model, fsdp, "32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer, TrainingState(model, optimizer, None, Precision("32", torch.device("cpu")),
                                           0, sharded=True)


def train(model, optimizer, steps: int) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 0, 1])).backward()
        optimizer.step()


def test_a_parameter_without_a_gradient_resumes_and_a_ddp_checkpoint_is_one_line(tmp_path):
    """Every restart failed: "Missing key in checkpoint state_dict: optimizer.state.pooler..."."""
    torch.manual_seed(0)
    model, optimizer, state = sharded(WithPooler())
    train(model, optimizer, 2)
    state.write(tmp_path)
    torch.manual_seed(0)
    again, optimizer2, state2 = sharded(WithPooler())
    state2.load(tmp_path, torch.device("cpu"))
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
    # trainer.parallel=ddp resumes sharded state (FSDP's, a pipeline's) whole on each rank
    plain = WithPooler()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=0.1)
    TrainingState(plain, plain_optimizer, None, Precision("32", torch.device("cpu")), 0,
                  sharded=False).load(tmp_path, torch.device("cpu"))
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a.full_tensor(), b), name
    assert plain_optimizer.state_dict()["state"][0]["step"] == 2
    train(model, optimizer, 1)
    train(again, optimizer2, 1)  # the same update from the restored optimizer state
    assert all(torch.equal(a.full_tensor(), b.full_tensor())
               for a, b in zip(model.parameters(), again.parameters(), strict=True))
    with pytest.raises(OtherParallelMode, match="holds no sharded state .*trainer.parallel=ddp"):
        state2.load(tmp_path / "nothing", torch.device("cpu"))
    assert OtherParallelMode.retry is False


def test_nested_blocks_shard_inner_first_and_meta_init_fills_attention(tmp_path):
    model = nn.Sequential(ResBlock(), ResBlock())
    assert [type(b).__name__ for b in blocks(model, [])] == ["ResBlock", "MLPBlock"] * 2
    model, optimizer, _ = sharded(model)  # parent first: a TypeError inside DeviceMesh
    train_x = torch.randn(4, 8)
    assert model(train_x).shape == (4, 8)

    with torch.device("meta"):
        layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
    materialize(layer, torch.device("cpu"), seed=3)
    weight = layer.self_attn.in_proj_weight  # nn.MultiheadAttention: only _reset_parameters
    assert torch.isfinite(weight).all() and 0.01 < weight.std() < 1.0
    assert not layer.self_attn.out_proj.bias.any()  # zeroed after its Linear's reset, as torch does


def test_a_block_name_no_module_has_is_refused_by_the_trial():
    from trainers.pytorch.check import check_fsdp_blocks

    check_fsdp_blocks(nn.Sequential(ResBlock()), ["ResBlock"])
    with pytest.raises(ConfigError, match=r"^trainer.fsdp.blocks: 'Blok' is no module class of "
                                          r"the model \(it has"):
        check_fsdp_blocks(nn.Sequential(ResBlock()), ["Blok"])


def test_a_failed_background_save_is_an_error_the_upload_thread_reports(tmp_path, monkeypatch):
    """DCP's CheckpointException is a BaseException: it ended the upload thread unreported,
    and every later flush (the run's end) waited forever."""
    from torch.distributed.checkpoint import FileSystemWriter

    model, optimizer, state = sharded(nn.Sequential(MLPBlock()))
    train_loss = model(torch.randn(2, 8)).sum()
    train_loss.backward()
    optimizer.step()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    pending = state.write(tmp_path, background=True)
    with pytest.raises(RuntimeError, match="No space left on device"):
        pending.result(timeout=60)
