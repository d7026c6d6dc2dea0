"""The general PyTorch trainer's loop (trainer=ddp, trainer=fsdp), run by the training
function in trainers/pytorch/train.py.

Exactness: the global batch at a step is fixed by (seed, step) whatever the world size; each
micro-batch's mean loss is weighted by its rows * world_size / global batch, so that the
averaged gradient is the mean over the global batch however the rows are spread over ranks
and micro-batches; per-step randomness is seeded from (seed, step, rank). A resumed run
replays the same computation as one that never stopped.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from functools import partial

import ray.train.torch
import torch
import torch.distributed as dist
from hydra.utils import instantiate

from orchestrator.data.order import step_seed
from orchestrator.worker_api import WorkerContext
from trainers.neural import standardize, total_steps
from trainers.pytorch.data import (
    EVERY_RANK,
    StepPlan,
    already_batched,
    collate_function,
    eval_shards,
    loader,
    step_batches,
    streamed_feed,
    tabular,
    to_device,
)
from trainers.pytorch.finite_loss import LossWatch
from trainers.pytorch.host_memory import release_freed_memory, wanted
from trainers.pytorch.mesh import model_parallel
from trainers.pytorch.parallel import materialize, no_sync, parallelize
from trainers.pytorch.parts import (
    Step,
    build_model,
    build_optimizer,
    build_scheduler,
    build_step,
    metric_names,
)
from trainers.pytorch.precision import Precision
from trainers.pytorch.state import TrainingState
from trainers.pytorch.tasks import MetricSums


def seed_step(seed: int, device: torch.device) -> None:
    """What torch.manual_seed does for the devices in use, without its cost: on a CPU-only
    machine it also queues lazy seeding calls for CUDA, XPU and MTIA, each formatting a
    stack trace (~0.1-0.5 ms a step, 3% of a small model's step time)."""
    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def datasets(ctx: WorkerContext, dcfg: dict):
    """(train, eval, collate): the user's datasets (data=torch), or the tabular ones; None
    for streamed parquet (read a window at a time by the feed)."""
    if ctx.streamed:
        return None, None, already_batched
    if dcfg["name"] == "torch":
        return (instantiate(dict(dcfg["train"]), _convert_="all"),
                instantiate(dict(dcfg["eval"]), _convert_="all"),
                collate_function(dcfg.get("collate_fn")))
    return (*tabular(ctx.dataset(), standardize), already_batched)


def main(ctx: WorkerContext, cfg: dict) -> dict[str, float] | None:
    tcfg, dcfg = cfg["trainer"], cfg["data"]
    if model_parallel(tcfg):
        from trainers.pytorch.mesh_loop import main as on_a_mesh

        return on_a_mesh(ctx, cfg)
    task = dcfg.get("task") or "classification"
    device = ray.train.torch.get_device()
    if wanted(tcfg.get("release_host_memory"), tcfg["parallel"], device.type):
        release_freed_memory()
    torch.manual_seed(ctx.seed)  # the same initial weights on every rank and every attempt
    train_set, eval_set, collate = datasets(ctx, dcfg)
    sharded = tcfg["parallel"] == "fsdp"
    meta = sharded and (tcfg.get("fsdp") or {}).get("meta_init")
    with torch.device("meta") if meta else nullcontext():
        module = build_model(tcfg)
    model = parallelize(module if meta else module.to(device), tcfg, ctx.world_size, device)
    if meta:
        materialize(module, device, ctx.seed * 100_003 + ctx.rank)
    step_fn = build_step(tcfg, task)
    optimizer = build_optimizer(tcfg, module.parameters())  # FSDP: this rank's shards
    scheduler = build_scheduler(tcfg, optimizer)
    precision = Precision(tcfg["precision"], device, autocast=not sharded)
    state = TrainingState(module, optimizer, scheduler, precision, ctx.rank, sharded)
    background_saves = sharded and (tcfg.get("fsdp") or {}).get("async_save", True)
    if (path := ctx.restore(state.files())) is not None:  # only what this rank loads
        state.load(path, device, ctx.restore)

    batch_size = int(tcfg["batch_size"])
    batches = ctx.stream(batch_size) if ctx.streamed else ctx.batches(len(train_set), batch_size)
    plan = StepPlan(batches, ctx.world_size, tcfg.get("micro_batch_size"))
    ctx.total_steps = total_steps(tcfg, plan.batches.steps_per_epoch)
    workers = int(dcfg.get("num_workers") or 0)
    feed = training_feed(ctx, plan, train_set, collate, workers, device)
    evaluate = Evaluation(ctx, module, step_fn, eval_set, collate, metric_names(tcfg, task),
                          precision, eval_batch_size(tcfg, ctx.world_size), workers, device,
                          batches if ctx.streamed else None)
    # Each micro-batch's mean loss weighs its rows out of the step's: the gradient is the
    # mean over the rows the step trains on (all of them, for data smaller than one batch).
    step_rows = plan.batches.rows_a_step
    scale = ctx.world_size / step_rows
    watch = LossWatch(bool(tcfg.get("allow_nonfinite_loss")), device)

    model.train()
    for step in range(ctx.start_step, ctx.total_steps):
        seed_step(ctx.step_seed(step), device)
        optimizer.zero_grad(set_to_none=True)
        micro_batches = plan.micro_batches(step)
        loss_sum, rows, means = 0.0, 0, {}
        for i, micro in enumerate(micro_batches):
            batch = to_device(next(feed), device)
            with nullcontext() if i == len(micro_batches) - 1 else no_sync(model):
                with precision.autocast():
                    loss, metrics = step_fn(model, batch)
                n = len(micro.rows)
                precision.backward(loss * (n * micro.weight * scale))
            if micro.weight:
                loss_sum, rows = loss_sum + loss.detach() * n, rows + n
                for name, value in metrics.items():
                    means[name] = means.get(name, 0.0) + torch.as_tensor(value).detach() * n
        precision.step(optimizer, module.parameters(), tcfg.get("grad_clip"))
        if scheduler is not None:
            scheduler.step()
        reported = {"loss": loss_sum / max(rows, 1), **{k: v / max(rows, 1) for k, v in means.items()}}
        ctx.step_done(step + 1, reported, samples=step_rows)
        if rows:  # a rank given only padding this step has no loss of its own
            watch.see(step + 1, reported["loss"])
        if ctx.should_evaluate(step + 1):
            watch.check()
            ctx.eval_done(step + 1, evaluate())
        if ctx.should_save(step + 1):
            watch.check()  # no checkpoint of NaN weights
            # The last checkpoint and a preemption's: no step to overlap, so no copy.
            last = ctx.should_preempt() or step + 1 >= ctx.total_steps
            ctx.save(step + 1, partial(state.write, background=background_saves and not last))
        if ctx.should_preempt():
            return None
    watch.check()
    return evaluate()


def training_feed(ctx: WorkerContext, plan: StepPlan, train_set, collate, workers: int,
                  device: torch.device):
    """The micro-batches of the steps left to train, in order: streamed, or from the dataset."""
    if ctx.streamed:
        return streamed_feed(plan.batches, plan, ctx.start_step, ctx.total_steps)
    return step_batches(train_set, plan, ctx.start_step, ctx.total_steps, collate, workers,
                        device, partial(step_seed, ctx.seed, rank=EVERY_RANK))


def eval_batch_size(tcfg: dict, world_size: int) -> int:
    """A rank's held-out batch: no larger than what it forwards at once in training (the
    global batch held whole on each rank ran out of GPU memory at the last evaluation)."""
    return int(tcfg.get("micro_batch_size") or math.ceil(int(tcfg["batch_size"]) / world_size))


class Evaluation:
    """Held-out metrics: every rank evaluates every world_size-th row, one all-reduce adds
    the sums up; every rank gets the result."""

    def __init__(self, ctx: WorkerContext, module, step_fn: Step, dataset, collate, names,
                 precision: Precision, batch_size: int, workers: int, device: torch.device,
                 streamed=None, replica: tuple[int, int] | None = None, group=None):
        self.ctx, self.module, self.step_fn, self.dataset = ctx, module, step_fn, dataset
        self.collate, self.names, self.precision = collate, names, precision
        self.batch_size, self.workers, self.device = batch_size, workers, device
        self.streamed = streamed  # StreamedBatches: held-out rows read from this rank's share
        # Tensor parallel: the ranks of one replica evaluate the same rows; the sums are added
        # over the replicas (``group``), not over every rank.
        self.replica = replica or (ctx.rank, ctx.world_size)
        self.group = group

    def batches(self):
        """(batch, weight, items) of this rank's held-out rows."""
        if self.streamed is not None:
            return ((tuple(map(torch.from_numpy, (x, y))), w, len(y))
                    for x, y, w in self.streamed.eval_batches(self.batch_size))
        shards = eval_shards(len(self.dataset), *self.replica, self.batch_size)
        batches = loader(self.dataset, [s.rows.tolist() for s in shards], self.collate,
                         self.workers, self.device, self.ctx.seed)
        return ((batch, shard.weight, len(shard.rows))
                for shard, batch in zip(shards, batches, strict=True))

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        training = self.module.training  # also called between steps (run.eval_every_steps)
        self.module.eval()
        sums = MetricSums(self.step_fn.task, self.names, self.device)
        for batch, weight, items in self.batches():
            with self.precision.autocast():
                self.step_fn.measure(self.module, to_device(batch, self.device), sums, weight,
                                     items)
        self.module.train(training)
        distributed = self.replica[1] > 1 and dist.is_initialized()
        return sums.reduce(partial(dist.all_reduce, group=self.group) if distributed else None)
