"""Before Ray starts, on the driver: resolve every _target_, build the user's parts, and run one
training step and the evaluation step with its reduction on a tiny CPU batch. What fails
becomes one line naming the key (exit 2), within seconds instead of after the cluster's
start-up, or after the last training step."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from hydra.utils import instantiate

from orchestrator.errors import ConfigError, cause_of, one_line
from trainers.pytorch.config import NotFound, given, locate
from trainers.pytorch.data import collate_function, to_device
from trainers.pytorch.mesh import check_layout, model_parallel
from trainers.pytorch.parts import (
    Step,
    build_model,
    build_optimizer,
    build_scheduler,
    build_step,
    classes_beyond_outputs,
    metric_names,
)
from trainers.pytorch.tasks import MetricSums, fitted, split_batch

log = logging.getLogger(__name__)


@contextmanager
def named(key: str, doing: str = ""):
    try:
        yield
    except ConfigError:
        raise
    except Exception as exc:
        cause = cause_of(exc)
        raise ConfigError(f"{key}: {doing}{type(cause).__name__}: {one_line(cause)[:240]}") from None


def target_nodes(cfg: dict):
    """(key, import path) of every _target_ the workers will import."""
    tcfg, dcfg = cfg["trainer"], cfg["data"]
    for key in ("model", "loss", "step_fn", "optimizer", "scheduler"):
        if given(tcfg.get(key)):
            yield f"trainer.{key}", tcfg[key]["_target_"]
    for i, metric in enumerate(tcfg.get("metrics") or []):
        if isinstance(metric, dict):
            yield f"trainer.metrics[{i}]", metric["_target_"]
    if dcfg.get("name") == "torch":
        for key in ("train", "eval", "collate_fn"):
            if given(dcfg.get(key)):
                yield f"data.{key}", dcfg[key]["_target_"]


def check_targets(cfg: dict) -> None:
    """Each _target_ resolves, or one line naming the key and what is missing."""
    for key, path in target_nodes(cfg):
        try:
            locate(path)
        except NotFound as exc:
            raise ConfigError(f"{key}._target_={path!r}: {exc}") from None
        except Exception as exc:  # noqa: BLE001  (the user's module fails on import)
            raise ConfigError(f"{key}._target_={path!r}: importing it failed: "
                              f"{type(exc).__name__}: {one_line(exc)[:240]}") from None


def tiny_batches(dcfg: dict, tcfg: dict):
    """Two items of the training data and two of the held-out data, batched as the workers
    will (tabular data: two rows of the configured width, and no held-out batch of its own)."""
    if dcfg["name"] != "torch":
        target = torch.zeros(2) if dcfg.get("task") == "regression" else torch.zeros(2, dtype=torch.long)
        return (torch.zeros(2, int(dcfg["features"])), target), None, []
    collate = collate_function(dcfg.get("collate_fn"))
    batches = []
    for key in ("train", "eval"):
        with named(f"data.{key}", "building it: "):
            dataset = instantiate(dict(dcfg[key]), _convert_="all")
        with named(f"data.{key}", "reading items 0 and 1: "):
            items = [dataset[i] for i in range(min(2, len(dataset)))]
            if not items:
                raise ValueError("the dataset is empty")
        if key == "train":
            notes = what_the_items_mean(len(dataset), items[0], tcfg)
        with named("data.collate_fn", f"batching two items of data.{key}: "):
            batches.append(collate(items))
    return batches[0], batches[1], notes


def what_the_items_mean(size: int, item, tcfg: dict) -> list[str]:
    """What the run would do silently with the user's data: warning lines, said once the
    trial passed (a failed one says its error alone)."""
    notes = []
    batch = int(tcfg.get("batch_size") or 0)
    if 0 < size < batch:
        notes.append(f"data.train holds {size} items, fewer than one global batch "
                     f"(trainer.batch_size={batch}): every step trains on all {size}")
    if isinstance(item, (tuple, list)) and len(item) > 2 and not given(tcfg.get("step_fn")):
        notes.append(f"data.train's items have {len(item)} parts: the default step takes the "
                     "first as the inputs and the second as the target, and ignores the rest (a "
                     "sample weight too); give trainer.step_fn to use them")
    return notes


def check_parts(cfg: dict) -> list[str] | None:
    """The trial, with the frameworks' warnings kept off the terminal (the user gets one
    line when something is wrong, nothing when all is well)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trial(cfg)


def trial(cfg: dict) -> list[str] | None:
    """The training step, the evaluation step and its reduction, on the tiny batch; returns
    the names of the metrics the run will report: held-out ones (test_*), then the training
    step's (loss, and a step function's own). None on the meta device (nothing evaluated)."""
    tcfg, dcfg = cfg["trainer"], cfg["data"]
    task = dcfg.get("task") or "classification"
    if tcfg.get("backend") not in ("torch", "gloo", "nccl"):
        raise ConfigError(f"trainer.backend={tcfg.get('backend')!r} is not allowed with this "
                          "trainer: torch, gloo or nccl")
    check_targets(cfg)
    # A model meant to be too large for one worker (trainer.fsdp.meta_init) is tried on the
    # meta device: shapes and types, no memory.
    # So is a model cut into stages or split over workers (trainer.pipeline/tensor).
    meta = (tcfg.get("parallel") == "fsdp" and (tcfg.get("fsdp") or {}).get("meta_init")) or \
        model_parallel(tcfg)
    device = torch.device("meta" if meta else "cpu")
    with named("trainer.model", "building it: "), device:
        model = build_model(tcfg)
    if model_parallel(tcfg):
        check_layout(model, tcfg)
    if tcfg.get("parallel") == "fsdp":
        check_fsdp_blocks(model, list((tcfg.get("fsdp") or {}).get("blocks") or []))
    with named("trainer.step_fn" if given(tcfg.get("step_fn")) else "trainer.loss", "building it: "):
        step = build_step(tcfg, task)
    batch, held_out, notes = tiny_batches(dcfg, tcfg)
    batch = to_device(batch, device)
    if dcfg["name"] == "torch" and not meta:
        check_finite_items(batch, dcfg)
    metrics: dict = {}  # the default step reports the loss alone while training
    if step.user_step is not None:
        with named("trainer.step_fn", "on a batch of data.train: "):
            loss, metrics = step(model, batch)
        key = "trainer.step_fn"
    else:
        with named("data.train", "its batches: "):
            inputs, target = split_batch(batch)
        with named("trainer.model", "its forward on a batch of data.train failed: "):
            output = fitted(model(inputs), target, task)
        with named("trainer.loss", "on the model's output and the target: "):
            try:
                loss = step.loss_fn(output, target)
            except IndexError as exc:
                if (beyond := classes_beyond_outputs(exc, output, target)) is exc:
                    raise
                raise ConfigError(f"trainer.model: {beyond}") from None
        key = "trainer.loss"
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigError(f"{key}: it gave {shape}; the loss must be one number (the batch's mean)")
    with named("trainer.model", "backward from the loss failed: "):
        loss.backward()
    if tcfg.get("parallel") == "ddp" and not tcfg.get("find_unused_parameters"):
        check_every_parameter_learns(model)
    with named("trainer.optimizer", "building it on the model's parameters: "):
        optimizer = build_optimizer(tcfg, model.parameters())
        optimizer.step()
    with named("trainer.scheduler", "building it on the optimizer: "):
        scheduler = build_scheduler(tcfg, optimizer)
    if scheduler is not None:
        check_stepped_alone(scheduler)
        with named("trainer.scheduler", "stepping it after the optimizer's step: "):
            scheduler.step()
    if meta:
        say(notes)
        return None
    names = evaluation(tcfg, task, step, model, batch)
    if held_out is not None:  # the held-out items through the same step: their own types
        model.eval()
        with named("data.eval", "items 0 and 1 through the evaluation step: "), torch.no_grad():
            step.measure(model, held_out, MetricSums(task, metric_names(tcfg, task), device))
        model.train()
    say(notes)
    return names + ["loss", *metrics]


def check_fsdp_blocks(model, names: list[str]) -> None:
    """A name in trainer.fsdp.blocks that no module of the model has (a typo): only the whole
    model would be sharded, gathered at once, the memory saving silently lost."""
    classes = {type(m).__name__ for m in model.modules()}
    missing = [name for name in names if name not in classes]
    if missing:
        raise ConfigError(f"trainer.fsdp.blocks: {', '.join(map(repr, missing))} is no module class "
                          f"of the model (it has {', '.join(sorted(classes)[:8])}"
                          f"{', ...' if len(classes) > 8 else ''})")


def say(notes: list[str]) -> None:
    """Warnings of the trial: a log line where logging is set up (a served command, a sweep's
    trial), else, before Hydra sets it up, a line like the checks' `error:` ones."""
    import sys

    for note in notes:
        if logging.getLogger().hasHandlers():
            log.warning("%s", note)
        else:
            print(f"warning: {note}", file=sys.stderr, flush=True)


def check_every_parameter_learns(model) -> None:
    """DDP on 2 or more workers waits for every parameter's gradient: one the step leaves
    without (a head it never calls) stops the run at its second step."""
    idle = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if idle:
        raise ConfigError(
            f"trainer.model: the training step leaves {len(idle)} parameter"
            f"{'s' if len(idle) > 1 else ''} without a gradient ({', '.join(idle[:3])}"
            f"{', ...' if len(idle) > 3 else ''}), which stops DDP on 2 or more workers: set "
            "trainer.find_unused_parameters=true, or freeze them (requires_grad=False)")


def check_stepped_alone(scheduler) -> None:
    """The run steps its scheduler after every optimizer step, with no argument: one that
    needs a metric (ReduceLROnPlateau) would fail at the first step."""
    import inspect

    try:
        needed = [p.name for p in inspect.signature(scheduler.step).parameters.values()
                  if p.default is inspect.Parameter.empty
                  and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):  # no signature to read: stepping it will say
        return
    if needed:
        raise ConfigError(
            f"trainer.scheduler: {type(scheduler).__name__}.step() needs {', '.join(needed)}, "
            "but the run steps its scheduler after every optimizer step with no argument: use "
            "a schedule of steps (CosineAnnealingLR, OneCycleLR, StepLR, LambdaLR, ...)")


def evaluation(tcfg: dict, task: str, step: Step, model, batch) -> list[str]:
    """The held-out metrics of the tiny batch, through the workers' own evaluation step and
    reduction: an error there would otherwise come after the last training step."""
    key = "trainer.step_fn" if step.user_step is not None else "trainer.metrics"
    sums = MetricSums(task, metric_names(tcfg, task), torch.device("cpu"))
    model.eval()
    with named(key, "in evaluation: "), torch.no_grad():
        step.measure(model, batch, sums)
        metrics = sums.reduce(None)
    model.train()
    # Names the user chose must all come out (a task's defaults: those the step can give).
    missing = [n for n in sums.names if f"test_{n}" not in metrics] if tcfg.get("metrics") else []
    if missing and step.user_step is None:
        raise ConfigError(f"trainer.metrics: {', '.join(missing)} not computed for "
                          f"data.task={task!r}")
    if missing:
        own = sorted(k[5:] for k in metrics if k[5:] not in sums.names)
        raise ConfigError(
            f"trainer.metrics: {', '.join(missing)} cannot be computed: trainer.step_fn gives "
            f"the loss and its own metrics ({', '.join(own) or 'none'}), not the model's "
            f"output; return {missing[0]} from it as (loss, {{{missing[0]!r}: ...}}), or leave "
            "trainer.metrics null")
    return list(metrics)


def check_finite_items(batch, dcfg: dict) -> None:
    """NaN or inf in the first items of data.train: every step would be NaN."""
    bad = sum(int((~torch.isfinite(t)).sum()) for t in tensors_in(batch) if t.is_floating_point())
    if bad and not dcfg.get("allow_nonfinite"):
        raise ConfigError(f"data.train: items 0 and 1 hold {bad} non-finite "
                          f"value{'s' if bad > 1 else ''} (NaN or inf), which make the loss "
                          "NaN: clean the data, or set data.allow_nonfinite=true")


def tensors_in(batch):
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from tensors_in(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from tensors_in(value)
