"""Per-step seeding of the DDP trainer: as torch.manual_seed on CPU, for a fraction of its cost."""

from __future__ import annotations

import torch

from trainers.ddp.trainer import DDPTrainer


def test_step_seed_gives_the_dropout_of_manual_seed():
    trainer = object.__new__(DDPTrainer)  # only the seeding is under test
    trainer.device = torch.device("cpu")
    dropout, x = torch.nn.Dropout(0.5), torch.ones(4096)
    torch.manual_seed(1234)
    expected = dropout(x)
    torch.manual_seed(99)
    trainer._seed_step(1234)
    assert torch.equal(dropout(x), expected)
