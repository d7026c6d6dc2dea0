"""The PyTorch trainer's loop on a device mesh (trainer.pipeline.degree or trainer.tensor.degree
above 1; trainers/pytorch/mesh.py lays it out), run in place of the data-parallel loop.

The same computation as that loop, at any P, T and D: the global batch of a step is fixed by
(seed, step); the ranks of one replica (its stages and tensor shards) read the same rows, the
replicas split the batch; each micro-batch's mean loss weighs its rows out of the step's, and
the replicas' gradients are summed (one all-reduce over the data-parallel axis), so the
gradient is the mean over the global batch. The loss and the held-out metrics come from the
last stage, and every rank reports them (rank 0 draws the curves).
"""

from __future__ import annotations

from functools import partial

import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn

from orchestrator.worker_api import WorkerContext
from trainers.neural import total_steps
from trainers.pytorch.data import StepPlan, to_device
from trainers.pytorch.finite_loss import LossWatch
from trainers.pytorch.loop import (
    Evaluation,
    datasets,
    eval_batch_size,
    seed_step,
    training_feed,
)
from trainers.pytorch.mesh import (
    Degrees,
    MeshRefused,
    Stage,
    cut,
    degrees,
    layer_names_or_all,
    materialize,
    parallelize_tensors,
    tensor_plan,
)
from trainers.pytorch.parallel import shard
from trainers.pytorch.parts import (
    build_model,
    build_optimizer,
    build_scheduler,
    build_step,
    metric_names,
)
from trainers.pytorch.precision import Precision
from trainers.pytorch.state import TrainingState
from trainers.pytorch.tasks import MetricSums, fitted, split_batch

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved_1f1b": "ScheduleInterleaved1F1B"}


def held_layers(whole: nn.Module, tcfg: dict, degree: Degrees, pp_rank: int):
    """(the module holding every layer this rank has, their names, one Stage per pipeline
    stage it runs, their indices). An interleaved schedule runs two stages a rank: pp_rank
    and pp_rank + P. Without a pipeline, the whole model."""
    p = degree.pipeline
    if p == 1:
        return whole, layer_names_or_all(whole), [], []
    per_rank = 2 if (tcfg.get("pipeline") or {}).get("schedule") == "interleaved_1f1b" else 1
    ids = [pp_rank + k * p for k in range(per_rank)]
    stages = [cut(whole, tcfg, i, p * per_rank) for i in ids]
    held = Stage(whole, [n for s in stages for n in s.layer_names])
    return held, held.layer_names, stages, ids


def reduce_gradients(parameters: list[nn.Parameter], group) -> None:
    """Sum the replicas' gradients: one all-reduce of them all, flattened (the loss already
    weighs each micro-batch by its rows out of the global batch's)."""
    grads = []
    for p in parameters:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(local(p.grad))
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage, written in place), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():  # outside autograd, to_local() is the shard itself, not a copy
        return t.to_local()


def clip_gradients(parameters: list[nn.Parameter], max_norm: float, pp_group) -> None:
    """torch's clip_grad_norm_ over the whole model: the norms of tensor-parallel shards
    made whole, then the stages' squares added up."""
    from torch.distributed.tensor import DTensor

    squares = torch.zeros((), dtype=torch.float64, device=parameters[0].device)
    for p in parameters:
        if p.grad is None:
            continue
        norm = torch.linalg.vector_norm(p.grad)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares = squares + norm.double() ** 2
    if pp_group is not None:
        dist.all_reduce(squares, group=pp_group)
    coefficient = torch.clamp(max_norm / (squares.sqrt() + 1e-6), max=1.0)
    for p in parameters:
        if p.grad is not None:
            local(p.grad).mul_(coefficient.to(p.grad.dtype))


def main(ctx: WorkerContext, cfg: dict) -> dict[str, float] | None:
    from torch.distributed.device_mesh import init_device_mesh

    tcfg, dcfg = cfg["trainer"], cfg["data"]
    task = dcfg.get("task") or "classification"
    device = ray.train.torch.get_device()
    degree = degrees(tcfg, ctx.world_size)
    mesh = init_device_mesh(device.type, (degree.pipeline, degree.data, degree.tensor),
                            mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    replica = (dp_rank, degree.data)
    dp_group = mesh.get_group("dp") if degree.data > 1 else None
    pp_group = mesh.get_group("pp") if degree.pipeline > 1 else None
    torch.manual_seed(ctx.seed)
    train_set, eval_set, collate = datasets(ctx, dcfg)

    with torch.device("meta"):  # no rank ever holds the whole model
        whole = build_model(tcfg)
    held, layers, stage_modules, stage_ids = held_layers(whole, tcfg, degree, pp_rank)
    materialize(held, layers, device, ctx.seed)
    if degree.tensor > 1:
        parallelize_tensors(held, tensor_plan(whole, tcfg), mesh["tp"])
    # trainer.parallel=fsdp: each stage sharded over the replicas (the stages run their own
    # forwards, so each is a unit of its own); ddp: one all-reduce of the gradients a step.
    sharded_replicas = tcfg.get("parallel") == "fsdp" and degree.data > 1
    if sharded_replicas:
        for module in stage_modules or [held]:
            shard(module, tcfg.get("fsdp") or {}, "32", mesh["dp"], summed=True)
    del whole
    parameters = [p for p in held.parameters() if p.requires_grad]
    step_fn = build_step(tcfg, task)
    optimizer = build_optimizer(tcfg, held.parameters())
    scheduler = build_scheduler(tcfg, optimizer)
    precision = Precision(tcfg["precision"], device)
    state = TrainingState(held, optimizer, scheduler, precision, ctx.rank, sharded=True,
                          flat_optimizer=True)
    if (path := ctx.restore(state.files())) is not None:
        state.load(path, device, ctx.restore)

    batch_size = int(tcfg["batch_size"])
    batches = ctx.stream(batch_size, replica) if ctx.streamed else \
        ctx.batches(len(train_set), batch_size, replica)
    microbatches = int((tcfg.get("pipeline") or {}).get("microbatches") or 1) if degree.pipeline > 1 else 1
    mbs = tcfg.get("micro_batch_size")
    plan = StepPlan(batches, degree.data, int(mbs) * microbatches if mbs else None)
    if degree.pipeline > 1:
        check_even_shares(plan, degree, microbatches)
    ctx.total_steps = total_steps(tcfg, plan.batches.steps_per_epoch)
    workers = int(dcfg.get("num_workers") or 0)
    feed = training_feed(ctx, plan, train_set, collate, workers, device)
    step_rows = plan.batches.rows_a_step
    names = metric_names(tcfg, task)
    pipeline = Pipeline(stage_modules, stage_ids, degree, pp_group, device, tcfg, step_fn, task,
                        step_rows, microbatches) if degree.pipeline > 1 else None
    # A pipeline's held-out batches are a round of its training micro-batches (their shape)
    eval_rows = plan.batches.largest_share // len(plan.micro_batches(ctx.start_step)) \
        if pipeline is not None else eval_batch_size(tcfg, degree.data)
    evaluation = Evaluation(ctx, held, step_fn, eval_set, collate, names, precision, eval_rows,
                            workers, device, batches if ctx.streamed else None, replica, dp_group)
    evaluate = partial(pipeline.evaluate, evaluation) if pipeline is not None else evaluation
    watch = LossWatch(bool(tcfg.get("allow_nonfinite_loss")), device)

    held.train()
    for step in range(ctx.start_step, ctx.total_steps):
        seed_step(ctx.step_seed(step), device)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        rows = torch.zeros((), dtype=torch.float64, device=device)
        means: dict = {}  # a step function's own metrics (tensor parallel alone)
        for micro in plan.micro_batches(step):
            batch = to_device(next(feed), device)
            n = len(micro.rows)
            if pipeline is not None:
                with precision.autocast():
                    got, counted = pipeline.train(batch)
                loss_sum, rows = loss_sum + got, rows + counted
                continue
            with precision.autocast():
                loss, metrics = step_fn(held, batch)
            (loss * (n * micro.weight / step_rows)).backward()
            if micro.weight:
                loss_sum, rows = loss_sum + loss.detach().double() * n, rows + n
                for name, value in metrics.items():
                    means[name] = means.get(name, 0.0) + torch.as_tensor(value).detach() * n
        if dp_group is not None and not sharded_replicas:
            reduce_gradients(parameters, dp_group)
        if tcfg.get("grad_clip"):
            clip_gradients(parameters, float(tcfg["grad_clip"]), pp_group)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if pp_group is not None:  # the last stage's loss, on every stage
            both = torch.stack([loss_sum, rows])
            dist.all_reduce(both, group=pp_group)
            loss_sum, rows = both[0], both[1]
        reported = {"loss": loss_sum / rows.clamp(min=1),
                    **{k: v / rows.clamp(min=1) for k, v in means.items()}}
        ctx.step_done(step + 1, reported, samples=step_rows)
        if float(rows):
            watch.see(step + 1, reported["loss"])
        if ctx.should_evaluate(step + 1):
            watch.check()
            ctx.eval_done(step + 1, evaluate())
        if ctx.should_save(step + 1):
            watch.check()
            ctx.save(step + 1, state.write)
        if ctx.should_preempt():
            return None
    watch.check()
    return evaluate()


def check_even_shares(plan: StepPlan, degree: Degrees, microbatches: int) -> None:
    """A pipeline's micro-batches all have one shape (its stages' buffers are sized at the
    first): every replica's share splits evenly into them."""
    share, global_rows = plan.batches.largest_share, plan.batches.rows_a_step
    parts = len(plan.micro_batches(0))
    if global_rows % degree.data or share % (parts * microbatches):
        raise MeshRefused(
            f"a step's {global_rows} rows over {degree.data} data-parallel replicas in "
            f"{parts} x trainer.pipeline.microbatches={microbatches} micro-batches do not split "
            "evenly: a trainer.batch_size that is a multiple of "
            f"{degree.data * parts * microbatches}")


class Pipeline:
    """This rank's stages of the pipeline and the schedule that runs them."""

    def __init__(self, modules: list[Stage], ids: list[int], degree: Degrees, group, device,
                 tcfg: dict, step_fn, task: str, step_rows: int, microbatches: int):
        import torch.distributed.pipelining as pipelining

        count = degree.pipeline * len(ids)
        self.stages = [pipelining.PipelineStage(m, i, count, device, group=group)
                       for m, i in zip(modules, ids, strict=True)]
        self.first = any(s.is_first for s in self.stages)
        self.last = any(s.is_last for s in self.stages)
        self.step_fn, self.task, self.step_rows = step_fn, task, step_rows
        self.microbatches, self.group, self.degree, self.device = microbatches, group, degree, device
        cls = getattr(pipelining, SCHEDULES[(tcfg.get("pipeline") or {}).get("schedule", "1f1b")])
        # The loss weighs its rows out of the step's (scale_grads=False): the gradient is the
        # mean over the global batch, as in the data-parallel loop.
        self.schedule = cls(self.stages if len(self.stages) > 1 else self.stages[0], microbatches,
                            loss_fn=self._loss, scale_grads=False)

    def _loss(self, output, target):
        loss = self.step_fn.loss_fn(fitted(output, target, self.task), target)
        return loss * (target.shape[0] / self.step_rows)

    def _run(self, x, y, run, losses=None):
        args = (x,) if self.first else ()
        return run(*args, target=y if self.last else None, losses=losses)

    def train(self, batch) -> tuple[torch.Tensor, int]:
        """One round of the step's micro-batches through the schedule: (loss x rows, rows) on
        the last stage, zeros elsewhere. (The schedule's first step also calls the loss on
        tensors it makes up to learn the shapes: only ``losses`` holds the real ones.)"""
        x, y = split_batch(batch)
        losses: list = []
        self._run(x, y, self.schedule.step, losses)
        if not self.last:
            return torch.zeros((), dtype=torch.float64, device=self.device), 0
        return sum(loss.detach().double() for loss in losses) * self.step_rows, y.shape[0]

    @torch.no_grad()
    def evaluate(self, evaluation: Evaluation) -> dict[str, float]:
        """Held-out metrics through the pipeline's forward (its eval schedule), over the rows
        ``evaluation`` gives this replica: each batch padded to the training micro-batches'
        shape, the padding cut off the output on the last stage; the sums added over the
        replicas there, the result sent to every stage."""
        held, rows = evaluation.module, evaluation.batch_size
        training = held.training
        held.eval()
        sums = MetricSums(self.task, evaluation.names, self.device)
        try:
            for batch, weight, n in evaluation.batches():
                x, y = split_batch(to_device(batch, self.device))
                with evaluation.precision.autocast():
                    output = self._run(pad(x, rows), pad(y, rows), self.schedule.eval, [])
                if self.last and weight:
                    output, target = output[:n], y[:n]
                    loss = self.step_fn.loss_fn(fitted(output, target, self.task), target)
                    sums.add(output.float(), target, loss, weight, self.step_fn.threshold)
        finally:
            held.train(training)
        result: list = [None]
        if self.last:
            group = evaluation.group
            result[0] = sums.reduce(partial(dist.all_reduce, group=group)
                                     if group is not None else None)
        dist.broadcast_object_list(result, group=self.group,
                                   group_src=self.degree.pipeline - 1)
        return result[0]


def pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with its first row repeated up to ``rows`` rows."""
    if t.shape[0] >= rows:
        return t[:rows]
    return torch.cat([t, t[:1].expand(rows - t.shape[0], *t.shape[1:])])

