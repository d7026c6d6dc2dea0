"""Before Ray starts, on the driver: build the user's parts and run one forward and backward on
a tiny CPU batch. What fails becomes one line naming the key (exit 2), within seconds instead
of after the cluster's start-up."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from hydra.utils import instantiate

from orchestrator.errors import ConfigError, cause_of, one_line
from trainers.pytorch.config import given
from trainers.pytorch.data import collate_function, to_device
from trainers.pytorch.parts import (
    build_model,
    build_optimizer,
    build_scheduler,
    build_step,
    metric_names,
)
from trainers.pytorch.tasks import MetricSums, fitted, split_batch


@contextmanager
def named(key: str, doing: str = ""):
    try:
        yield
    except ConfigError:
        raise
    except Exception as exc:
        cause = cause_of(exc)
        raise ConfigError(f"{key}: {doing}{type(cause).__name__}: {one_line(cause)[:240]}") from None


def tiny_batch(dcfg: dict):
    """Two items of the training data, batched as the workers will (tabular data: two rows of
    the configured width)."""
    if dcfg["name"] != "torch":
        target = torch.zeros(2) if dcfg.get("task") == "regression" else torch.zeros(2, dtype=torch.long)
        return torch.zeros(2, int(dcfg["features"])), target
    with named("data.train", "building it: "):
        train = instantiate(dict(dcfg["train"]), _convert_="all")
    with named("data.train", "reading items 0 and 1: "):
        items = [train[i] for i in range(min(2, len(train)))]
        if not items:
            raise ValueError("the dataset is empty")
    with named("data.eval", "building it and reading item 0: "):
        held_out = instantiate(dict(dcfg["eval"]), _convert_="all")
        held_out[0], len(held_out)
    with named("data.collate_fn", "batching two items of data.train: "):
        return collate_function(dcfg.get("collate_fn"))(items)


def check_parts(cfg: dict) -> None:
    """The trial, with the frameworks' warnings kept off the terminal (the user gets one
    line when something is wrong, nothing when all is well)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trial(cfg)


def trial(cfg: dict) -> None:
    tcfg, dcfg = cfg["trainer"], cfg["data"]
    task = dcfg.get("task") or "classification"
    if tcfg.get("backend") not in ("torch", "gloo", "nccl"):
        raise ConfigError(f"trainer.backend={tcfg.get('backend')!r} is not allowed with this "
                          "trainer: torch, gloo or nccl")
    # A model meant to be too large for one worker (trainer.fsdp.meta_init) is tried on the
    # meta device: shapes and types, no memory.
    meta = tcfg.get("parallel") == "fsdp" and (tcfg.get("fsdp") or {}).get("meta_init")
    device = torch.device("meta" if meta else "cpu")
    with named("trainer.model", "building it: "), device:
        model = build_model(tcfg)
    with named("trainer.step_fn" if given(tcfg.get("step_fn")) else "trainer.loss", "building it: "):
        step = build_step(tcfg, task)
    batch = to_device(tiny_batch(dcfg), device)
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
            loss = step.loss_fn(output, target)
        key = "trainer.loss"
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigError(f"{key}: it gave {shape}; the loss must be one number (the batch's mean)")
    with named("trainer.model", "backward from the loss failed: "):
        loss.backward()
    with named("trainer.optimizer", "building it on the model's parameters: "):
        optimizer = build_optimizer(tcfg, model.parameters())
        optimizer.step()
    with named("trainer.scheduler", "building it on the optimizer: "):
        scheduler = build_scheduler(tcfg, optimizer)
        if scheduler is not None:
            scheduler.step()
    if step.user_step is None and not meta:
        with named("trainer.metrics", "on the model's output: "):
            sums = MetricSums(task, metric_names(tcfg, task), torch.device("cpu"))
            with torch.no_grad():
                sums.add(output.detach(), target, loss.detach())
            sums.reduce(None)
