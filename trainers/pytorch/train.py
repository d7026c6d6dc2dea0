"""The general PyTorch trainer as a training function (trainer=ddp, trainer=fsdp):
trainer.fn=trainers.pytorch.train:main.

Declared here without importing torch: the driver reads this function's schema (and a
trainer=script's cluster hook) for every command, and a command refused for a wrong key must
not wait for torch's start-up first. torch is imported by the check (a trial of the parts,
once the keys are right) and by the loop (trainers/pytorch/loop.py), on the workers.
"""

from __future__ import annotations

from orchestrator.worker_api import WorkerContext, training_function
from trainers.pytorch.config import PyTorchConfig, check_world


def check_parts(cfg: dict) -> list[str] | None:
    """The parts built and tried on the driver (trainers/pytorch/check.py); the names of the
    metrics the run will report."""
    from trainers.pytorch.check import check_parts as check

    return check(cfg)


# A worker's process imports what the torch backend names as it starts (Backend.warm_imports).
@training_function(config=PyTorchConfig, check=check_parts, streams=True, cluster=check_world)
def main(ctx: WorkerContext, cfg: dict) -> dict[str, float] | None:
    from trainers.pytorch.loop import main as loop

    return loop(ctx, cfg)
