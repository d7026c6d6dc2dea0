"""Per-step seeding of the DDP trainer: as torch.manual_seed on CPU, for a fraction of its cost."""

from __future__ import annotations

import torch

from trainers.pytorch.loop import seed_step


def test_step_seed_gives_the_dropout_of_manual_seed():
    dropout, x = torch.nn.Dropout(0.5), torch.ones(4096)
    torch.manual_seed(1234)
    expected = dropout(x)
    torch.manual_seed(99)
    seed_step(1234, torch.device("cpu"))
    assert torch.equal(dropout(x), expected)
