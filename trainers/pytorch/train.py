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


# A worker's process imports Ray Train's torch side as it starts, and stands a module in for
# torch._dynamo (~1 CPU-s a process, which torch.optim and DDP import and use only to mark
# what not to compile: trainers/pytorch/dynamo_stand_in.py).
WARM_IMPORTS = ("ray.train.torch", "trainers.pytorch.dynamo_stand_in:install")


@training_function(config=PyTorchConfig, check=check_parts, streams=True,
                   warm_imports=WARM_IMPORTS, cluster=check_world)
def main(ctx: WorkerContext, cfg: dict) -> dict[str, float] | None:
    from trainers.pytorch.dynamo_stand_in import install
    from trainers.pytorch.loop import main as loop

    install()  # where no setup hook did (GPU workers); nothing where torch._dynamo is loaded

    return loop(ctx, cfg)
