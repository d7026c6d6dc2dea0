"""The single-process runs the model-parallel tests compare with: the same model from the same
initial weights (trainers/pytorch/mesh.py's initialized), the same global batch at every step
(DataOrder), one process, no mesh, plain torch."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.config.schema import DataConfig
from orchestrator.data.datasets import load_dataset
from orchestrator.data.order import DataOrder
from orchestrator.storage.location import StorageSpec
from trainers.neural import standardize
from trainers.pytorch.mesh import initialized
from trainers.pytorch.models import MLP


def digits_mlp(steps: int, seed: int = 0, batch: int = 64, lr: float = 0.1) -> dict:
    """The default job's MLP on digits (SGD, momentum 0.9), trained ``steps`` steps."""
    data = load_dataset(DataConfig(), seed)
    x, _ = (torch.from_numpy(a) for a in standardize(data.x_train, data.x_test))
    y = torch.from_numpy(data.y_train)
    model = initialized(lambda: MLP(x.shape[1], 10, hidden=[128, 64]), seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    order = DataOrder(seed, len(y), batch)
    for step in range(steps):
        rows = torch.from_numpy(order.global_batch_rows(step))
        optimizer.zero_grad()
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        optimizer.step()
    return model.state_dict()


def char_lm(steps: int, seed: int = 0, batch: int = 32, lr: float = 0.1, **model) -> dict:
    """The char LM example's job with SGD (momentum 0.9, weight decay 0.01), gradient
    clipping at 1.0. (Not its AdamW: Adam scales every update to about lr, so a gradient
    that is float noise, a key bias's, moves by lr whatever its rounding.)"""
    from charlm.data import SourceBytes
    from charlm.model import TinyGPT
    from torch.utils.data import default_collate

    from trainers.pytorch.tasks import token_cross_entropy

    data = SourceBytes(split="train", seq_len=model.get("seq_len", 64))
    net = initialized(lambda: TinyGPT(**model), seed)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=0.01)
    order = DataOrder(seed, len(data), batch)
    for step in range(steps):
        x, y = default_collate([data[int(i)] for i in order.global_batch_rows(step)])
        optimizer.zero_grad()
        token_cross_entropy(net(x), y).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
    return net.state_dict()


def sharded_model_at(storage: Path, run: str, cache: Path, step: int | None = None) -> dict:
    """The whole model of a run's DCP checkpoint (its newest, or ``step``'s)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    store = CheckpointStore(StorageSpec(str(storage / run)))
    ref = store.latest() if step is None else store.ref(step)
    folder, _ = store.fetch_loaded(ref, cache / f"{run}-{ref.step}", lambda name: True)
    dcp_to_torch_save(folder / "dcp", folder / "whole.pt")  # our own checkpoint: trusted
    state = torch.load(folder / "whole.pt", weights_only=False)
    return state["model"]


def model_pt_at(storage: Path, run: str, step: int | None = None) -> dict:
    store = CheckpointStore(StorageSpec(str(storage / run)))
    ref = store.latest() if step is None else store.ref(step)
    return torch.load(io.BytesIO(store.load(ref)[0]["model.pt"]), weights_only=True)


def not_close(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> list[str]:
    """The parameters of ``a`` not within rtol (and atol, for values near 0) of ``b``'s."""
    assert sorted(a) == sorted(b), json.dumps([sorted(a), sorted(b)])
    return [f"{k}: {float((a[k] - b[k]).abs().max()):.3g}" for k in a
            if not torch.allclose(a[k].float(), b[k].float(), rtol=rtol, atol=atol)]
