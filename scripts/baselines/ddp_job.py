"""What the DDP baselines share with the orchestrator's DDP trainer: the same data (the same
loader, split, scaling and per-step rows), the same model and the same loss. Nothing of the
orchestrator's own machinery (run record, checkpoints, per-step seeding) is used.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from orchestrator.config.schema import DataConfig
from orchestrator.data.datasets import load_dataset
from orchestrator.data.order import DataOrder
from trainers.neural import standardize
from trainers.pytorch.models import MLP


def add_job_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", choices=("digits", "synthetic"), default="digits")
    parser.add_argument("--rows", type=int, default=10_000, help="synthetic rows")
    parser.add_argument("--features", type=int, default=20, help="synthetic features")
    parser.add_argument("--classes", type=int, default=2, help="synthetic classes")
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the result JSON here too")


@dataclass
class Job:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    order: DataOrder
    total_steps: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


def build(args: argparse.Namespace) -> Job:
    data = load_dataset(DataConfig(name=args.data, rows=args.rows, features=args.features,
                                   classes=args.classes), args.seed)
    x_train, x_test = standardize(data.x_train, data.x_test)
    torch.manual_seed(args.seed)
    model = MLP(data.num_features, data.num_classes, hidden=(128, 64))
    order = DataOrder(args.seed, len(data.y_train), args.batch_size)
    total = args.epochs * order.steps_per_epoch
    if args.max_steps:
        total = min(total, args.max_steps)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    return Job(torch.from_numpy(x_train), torch.from_numpy(data.y_train), torch.from_numpy(x_test),
               torch.from_numpy(data.y_test), order, total, model, optimizer)


def train(job: Job, ddp_model: torch.nn.Module, rank: int, world: int, batch_size: int) -> dict:
    """The training loop; returns timings: the first step's end and the steady-state rate
    (global samples/s from the end of the first step to the end of the last one)."""
    ddp_model.train()
    first_step_at = None
    for step in range(job.total_steps):
        rows = torch.from_numpy(job.order.shard(step, rank, world))
        x, y = job.x_train[rows], job.y_train[rows]
        loss_sum = F.cross_entropy(ddp_model(x), y, reduction="sum")
        loss = loss_sum * (world / batch_size)  # DDP's mean = the global batch's mean
        job.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        job.optimizer.step()
        loss_sum.item()
        if first_step_at is None:
            first_step_at = time.time()
    last_step_at = time.time()
    steady = (job.total_steps - 1) * batch_size / max(last_step_at - first_step_at, 1e-9)
    return {"first_step_at": first_step_at, "last_step_at": last_step_at,
            "steps": job.total_steps,
            "steady_samples_per_s": round(steady, 1) if job.total_steps > 1 else None}


@torch.no_grad()
def evaluate(job: Job) -> dict:
    job.model.eval()
    logits = job.model(job.x_test)
    return {"test_accuracy": float((logits.argmax(1) == job.y_test).float().mean()),
            "test_loss": float(F.cross_entropy(logits, job.y_test))}


def emit(result: dict, out: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
