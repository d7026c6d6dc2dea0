"""PyTorch DDP as a training function on the worker API (gloo on CPU, nccl on GPU).

Exactness: the global batch at a step is fixed by (seed, step) whatever the world size, the
loss is scaled so that DDP's gradient average equals the mean over the global batch, and
per-step randomness is seeded from (seed, step, rank); so a resumed run replays the same
computation as one that never stopped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ray.train.torch
import torch
import torch.nn.functional as F
from hydra.utils import instantiate

from orchestrator.worker_api import WorkerContext, training_function
from trainers.ddp.config import DDPConfig
from trainers.neural import check_model_target, standardize, total_steps


def make_optimizer(cfg: Mapping[str, Any], params) -> torch.optim.Optimizer:
    name, lr, wd = cfg["optimizer"], float(cfg["lr"]), float(cfg["weight_decay"])
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=float(cfg["momentum"]), weight_decay=wd)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=wd)
    return torch.optim.AdamW(params, lr=lr, weight_decay=wd)


def seed_step(seed: int, device: torch.device) -> None:
    """What torch.manual_seed does for the devices in use, without its cost: on a CPU-only
    machine it also queues lazy seeding calls for CUDA, XPU and MTIA, each formatting a
    stack trace (~0.1-0.5 ms a step, 3% of a small model's step time)."""
    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


@training_function(config=DDPConfig, check=check_model_target)
def main(ctx: WorkerContext, cfg: dict) -> dict[str, float] | None:
    tcfg = cfg["trainer"]
    data = ctx.dataset()
    torch.manual_seed(ctx.seed)  # the same initial weights on every rank and every attempt
    module = instantiate(dict(tcfg["model"]), in_features=data.num_features,
                         num_classes=data.num_classes, _convert_="all")
    x_train, x_test = (torch.from_numpy(x) for x in standardize(data.x_train, data.x_test))
    y_train, y_test = torch.from_numpy(data.y_train), torch.from_numpy(data.y_test)
    model = ray.train.torch.prepare_model(module)
    device = next(module.parameters()).device
    optimizer = make_optimizer(tcfg, module.parameters())
    if (path := ctx.restore()) is not None:
        module.load_state_dict(torch.load(path / "model.pt", map_location=device, weights_only=True))
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device,
                                             weights_only=True))
    batch_size = int(tcfg["batch_size"])
    batches = ctx.batches(len(y_train), batch_size)
    ctx.total_steps = total_steps(tcfg, batches.steps_per_epoch)

    def write(folder) -> None:
        if ctx.rank == 0:  # DDP replicates the state: one copy is the checkpoint
            torch.save(module.state_dict(), folder / "model.pt")
            torch.save(optimizer.state_dict(), folder / "optimizer.pt")

    @torch.no_grad()
    def evaluate() -> dict[str, float]:
        training = module.training  # also called between steps (run.eval_every_steps)
        module.eval()
        logits = module(x_test.to(device))
        module.train(training)
        y = y_test.to(device)
        return {"test_accuracy": float((logits.argmax(1) == y).float().mean()),
                "test_loss": float(F.cross_entropy(logits, y))}

    model.train()
    for step in range(ctx.start_step, ctx.total_steps):
        rows = torch.from_numpy(batches.rows(step))
        x, y = x_train[rows].to(device), y_train[rows].to(device)
        seed_step(ctx.step_seed(step), device)
        loss_sum = F.cross_entropy(model(x), y, reduction="sum")
        # DDP averages gradients over ranks; scaled so, the result is the mean over the
        # global batch even when ranks hold different numbers of rows.
        loss = loss_sum * (ctx.world_size / batch_size)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ctx.step_done(step + 1, {"loss": loss_sum.detach() / max(1, len(rows))}, samples=batch_size)
        if ctx.should_evaluate(step + 1):
            ctx.eval_done(step + 1, evaluate())
        if ctx.should_save(step + 1):
            ctx.save(step + 1, write)
        if ctx.should_preempt():
            return None
    return evaluate()
