"""The user's parts, built from their _target_ nodes: one builder for the workers and for the
driver's trial before Ray starts (trainers/pytorch/check.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import instantiate
from torch import nn

from trainers.pytorch.config import given, locate
from trainers.pytorch.tasks import (
    DEFAULT_METRICS,
    MetricSums,
    as_loss_and_metrics,
    default_loss,
    fitted,
    samples_in,
    split_batch,
)

# Keyword arguments of the shipped defaults (conf/trainer/ddp.yaml). Switching
# trainer.model._target_ or trainer.optimizer._target_ keeps them in the merged node (Hydra merges
# keys), so they reach the new target only where its signature takes them: a user's Net gets
# in_features/out_features from the data if it asks for them, AdamW never gets SGD's momentum.
DEFAULT_KEYS = {"model": {"in_features", "out_features", "hidden", "dropout"},
                "optimizer": {"momentum"}}


def accepted(node: dict, part: str) -> dict:
    """The node without the default's keys that its _target_ does not take."""
    import inspect

    try:
        parameters = inspect.signature(locate(node["_target_"])).parameters
    except Exception:  # noqa: BLE001  (no signature to read, or no such target: instantiate says)
        return dict(node)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(node)
    return {k: v for k, v in node.items()
            if k.startswith("_") or k not in DEFAULT_KEYS[part] or k in parameters}


def build_model(tcfg: dict) -> nn.Module:
    model = instantiate(accepted(tcfg["model"], "model"), _convert_="all")
    if not isinstance(model, nn.Module):
        raise TypeError(f"it built a {type(model).__name__}, not a torch.nn.Module")
    return model


def build_loss(tcfg: dict, task: str) -> Callable:
    node = tcfg.get("loss")
    if not given(node):
        return default_loss(task)
    if set(node) <= {"_target_", "_partial_"} and not isinstance(locate(node["_target_"]), type):
        return locate(node["_target_"])  # a loss function such as torch.nn.functional.mse_loss
    return instantiate(dict(node), _convert_="all")  # a loss module such as torch.nn.MSELoss


@dataclass
class Step:
    """(model, batch) -> (mean loss over the batch's samples, {metric: mean}), and for the
    default step also what held-out metrics need: the output and the target."""

    task: str
    loss_fn: Callable
    user_step: Callable | None
    threshold: float = 0.0  # one output a row: a logit (0), or a probability (0.5)

    def __call__(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict]:
        if self.user_step is not None:
            try:
                return as_loss_and_metrics(self.user_step(model, batch))
            except AttributeError as exc:
                if isinstance(model, nn.parallel.DistributedDataParallel) and \
                        "'DistributedDataParallel' object has no attribute" in str(exc):
                    raise StepCallsAModelMethod(
                        f"{exc}: on 2 or more workers trainer.step_fn gets the model wrapped by "
                        "DDP, which has only the model's forward: call model(...), and compute "
                        "the loss from its output in the step function") from exc
                raise
        loss, _, _ = self.forward(model, batch)
        return loss, {}

    def forward(self, model: nn.Module, batch: Any):
        inputs, target = split_batch(batch)
        output = fitted(model(inputs), target, self.task)
        try:
            return self.loss_fn(output, target), output, target
        except IndexError as exc:  # cross entropy's "Target 7 is out of bounds." (on CPU)
            raise classes_beyond_outputs(exc, output, target) from exc

    def measure(self, model: nn.Module, batch: Any, sums: MetricSums, weight: float = 1.0,
                items: int | None = None) -> None:
        """A held-out batch's part of the metrics: the workers' evaluation and the driver's
        trial both go through here, so what fails in one fails in the other. ``items``: the
        batch's dataset items, where known (a batch object of the user's need not say)."""
        if self.user_step is not None:
            loss, metrics = self(model, batch)
            sums.add_means(loss, metrics, items if items is not None else samples_in(batch), weight)
        else:
            loss, output, target = self.forward(model, batch)
            output = logits_of(output)
            sums.add(output.float() if isinstance(output, torch.Tensor) else output, target, loss,
                     weight, self.threshold)


def logits_of(output: Any) -> Any:
    """What the held-out metrics read of a model's output: the tensor itself, or the logits of
    an output object (a Hugging Face model's, with .logits or ["logits"])."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(getattr(output, "logits", None), torch.Tensor):
        return output.logits
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    return output


class StepCallsAModelMethod(AttributeError):
    """A step function that calls a method of the model other than its forward under DDP:
    every restart would meet it again."""

    retry = False


class ClassBeyondOutputs(IndexError):
    """A label the model's output has no column for: every restart would meet it again."""

    retry = False


def classes_beyond_outputs(exc: IndexError, output: torch.Tensor, target: torch.Tensor):
    """Torch's message, with what it means for the user's model where that is plain."""
    if not isinstance(output, torch.Tensor) or not isinstance(target, torch.Tensor) or \
            output.dim() < 2 or target.is_floating_point() or not target.numel():
        return exc
    width, largest = output.shape[-1], int(target.max())
    if largest < width:
        return exc
    return ClassBeyondOutputs(
        f"the model gives {width} outputs a row, but a target in this batch is class {largest}: "
        f"trainer.model needs one output per class (at least {largest + 1}) ({exc})")


def build_step(tcfg: dict, task: str) -> Step:
    node = tcfg.get("step_fn")
    user = None
    if given(node):
        user = locate(node["_target_"]) if set(node) <= {"_target_"} else \
            instantiate({**node, "_partial_": True})
    loss = build_loss(tcfg, task)
    # A loss of probabilities (BCELoss) means a model ending in a sigmoid: class 1 above 0.5.
    probabilities = isinstance(loss, nn.BCELoss) or loss is torch.nn.functional.binary_cross_entropy
    return Step(task, loss, user, 0.5 if probabilities else 0.0)


def build_optimizer(tcfg: dict, parameters) -> torch.optim.Optimizer:
    node = accepted(tcfg["optimizer"], "optimizer")
    return instantiate({**node, "_partial_": True}, _convert_="all")(parameters)


def build_scheduler(tcfg: dict, optimizer: torch.optim.Optimizer):
    node = tcfg.get("scheduler")
    if not given(node):
        return None
    return instantiate({**node, "_partial_": True}, _convert_="all")(optimizer)


def metric_names(tcfg: dict, task: str) -> list[Any]:
    return list(tcfg.get("metrics") or DEFAULT_METRICS[task])
