"""A user's own training loop: plain PyTorch DDP on scikit-learn's digits, written against the
orchestrator's public worker API only (orchestrator/worker_api.py). Every rank checkpoints a
file of its own (how many rows it trained on); rank 0 also the model and optimizer.

    python -m orchestrator trainer=function trainer.fn=mypkg.train:main +trainer.steps=300
"""

import json

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main(ctx, cfg):
    steps, batch = int(cfg["trainer"]["steps"]), int(cfg["trainer"].get("batch", 64))
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    torch.manual_seed(ctx.seed)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mine = {"rows_seen": 0}
    if (path := ctx.restore()) is not None:
        model.load_state_dict(torch.load(path / "model.pt"))
        optimizer.load_state_dict(torch.load(path / "optimizer.pt"))
        mine = json.loads((path / f"rank_{ctx.rank}.json").read_text())
    ddp = DistributedDataParallel(model)  # Ray set up the process group (trainer.backend=torch)

    def write(folder):
        if ctx.rank == 0:
            torch.save(model.state_dict(), folder / "model.pt")
            torch.save(optimizer.state_dict(), folder / "optimizer.pt")
        (folder / f"rank_{ctx.rank}.json").write_text(json.dumps(mine))

    batches = ctx.batches(len(y), batch)
    ctx.total_steps = steps
    for step in range(ctx.start_step, steps):
        rows = torch.from_numpy(batches.rows(step))
        torch.manual_seed(ctx.step_seed(step))  # dropout replays exactly after a resume
        loss = F.cross_entropy(ddp(x[rows]), y[rows], reduction="sum") * ctx.world_size / batch
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mine["rows_seen"] += len(rows)
        ctx.step_done(step + 1, {"loss": loss.detach() / ctx.world_size}, samples=batch)
        if ctx.should_save(step + 1):
            ctx.save(step + 1, write)
        if ctx.should_preempt():
            return None
    model.eval()
    with torch.no_grad():
        return {"accuracy": (model(x).argmax(1) == y).float().mean().item()}
