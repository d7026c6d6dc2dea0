"""The user's parts, built from their _target_ nodes: one builder for the workers and for the
driver's trial before Ray starts (trainers/pytorch/check.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import get_method, instantiate
from torch import nn

from trainers.pytorch.config import given
from trainers.pytorch.tasks import (
    DEFAULT_METRICS,
    as_loss_and_metrics,
    default_loss,
    fitted,
    split_batch,
)


def build_model(tcfg: dict) -> nn.Module:
    model = instantiate(dict(tcfg["model"]), _convert_="all")
    if not isinstance(model, nn.Module):
        raise TypeError(f"it built a {type(model).__name__}, not a torch.nn.Module")
    return model


def build_loss(tcfg: dict, task: str) -> Callable:
    node = tcfg.get("loss")
    if not given(node):
        return default_loss(task)
    if set(node) <= {"_target_", "_partial_"} and not isinstance(get_method(node["_target_"]), type):
        return get_method(node["_target_"])  # a loss function such as torch.nn.functional.mse_loss
    return instantiate(dict(node), _convert_="all")  # a loss module such as torch.nn.MSELoss


@dataclass
class Step:
    """(model, batch) -> (mean loss over the batch's samples, {metric: mean}), and for the
    default step also what held-out metrics need: the output and the target."""

    task: str
    loss_fn: Callable
    user_step: Callable | None

    def __call__(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict]:
        if self.user_step is not None:
            return as_loss_and_metrics(self.user_step(model, batch))
        loss, _, _ = self.forward(model, batch)
        return loss, {}

    def forward(self, model: nn.Module, batch: Any):
        inputs, target = split_batch(batch)
        output = fitted(model(inputs), target, self.task)
        return self.loss_fn(output, target), output, target


def build_step(tcfg: dict, task: str) -> Step:
    node = tcfg.get("step_fn")
    user = None
    if given(node):
        user = get_method(node["_target_"]) if set(node) <= {"_target_"} else \
            instantiate({**node, "_partial_": True})
    return Step(task, build_loss(tcfg, task), user)


def build_optimizer(tcfg: dict, parameters) -> torch.optim.Optimizer:
    return instantiate({**tcfg["optimizer"], "_partial_": True}, _convert_="all")(parameters)


def build_scheduler(tcfg: dict, optimizer: torch.optim.Optimizer):
    node = tcfg.get("scheduler")
    if not given(node):
        return None
    return instantiate({**node, "_partial_": True}, _convert_="all")(optimizer)


def metric_names(tcfg: dict, task: str) -> list[Any]:
    return list(tcfg.get("metrics") or DEFAULT_METRICS[task])
