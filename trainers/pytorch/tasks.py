"""What data.task decides: the default loss, how a batch splits into inputs and target, and
the held-out metrics, kept as sums so that every rank evaluates a shard and one all-reduce
adds them up.

A step function (the default one, or trainer.step_fn) maps (model, batch) to a loss that is
the *mean* over the batch's samples, and optionally {metric: mean value}.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

DEFAULT_METRICS = {
    "classification": ["accuracy", "loss"],
    "regression": ["mse", "r2", "loss"],
    "language_model": ["loss", "perplexity", "accuracy"],
}
# Dict batches whose keys say which is the input and which the target (any of each: a
# user's {"inputs": ..., "target": ...} is as clear as {"inputs": ..., "targets": ...}).
INPUT_KEYS = ("x", "input", "inputs", "input_ids", "image", "features")
TARGET_KEYS = ("y", "target", "targets", "labels", "label")


def token_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A language model's loss: cross entropy over every token ((B, T, V) logits, (B, T) ids)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def default_loss(task: str) -> Callable:
    return {"regression": F.mse_loss, "language_model": token_cross_entropy}.get(task, F.cross_entropy)


def split_batch(batch: Any) -> tuple[Any, torch.Tensor]:
    """(inputs, target) of a collated batch: a (x, y, ...) tuple or a dict with known keys."""
    if isinstance(batch, Sequence) and not isinstance(batch, str) and len(batch) >= 2:
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        x = next((k for k in INPUT_KEYS if k in batch), None)
        y = next((k for k in TARGET_KEYS if k in batch), None)
        if x is not None and y is not None:
            return batch[x], batch[y]
        raise ValueError(f"a batch is a dict with keys {sorted(batch)}: name them x and y (or "
                         "input/target, input_ids/labels), or give trainer.step_fn")
    raise ValueError(f"a batch is a {type(batch).__name__}, not (inputs, target): give "
                     "trainer.step_fn to say how it makes a loss")


def samples_in(batch: Any) -> int:
    """The number of samples (dataset items) in a collated batch: the first tensor's rows."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        for item in batch:
            n = samples_in(item)
            if n:
                return n
    return 0


def fitted(output: torch.Tensor, target: torch.Tensor, task: str) -> torch.Tensor:
    """A regression model's (B, 1) output against a (B,) target: the same shape, not (B, B)."""
    if task == "regression" and output.shape != target.shape and output.numel() == target.numel():
        return output.reshape(target.shape)
    return output


def as_loss_and_metrics(result: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping):
        return result[0], dict(result[1])
    return result, {}


def one_number(value: Any, what: str, device: torch.device) -> torch.Tensor:
    """A batch's mean as a 0-d double: sums of any other shape would not add up across
    batches and ranks (one all-reduce of the stacked sums)."""
    value = torch.as_tensor(value, device=device)
    if value.numel() != 1:
        raise ValueError(f"{what} is {tuple(value.shape)}, not one number (the batch's mean)")
    return value.reshape(()).double()


class MetricSums:
    """Held-out metrics as sums over samples (tokens for a language model), on the device."""

    def __init__(self, task: str, names: list[Any], device: torch.device):
        self.task, self.device = task, device
        self.names = [n if isinstance(n, str) else n["_target_"].rsplit(".", 1)[-1] for n in names]
        self.custom = {n if isinstance(n, str) else n["_target_"].rsplit(".", 1)[-1]: n
                       for n in names if not isinstance(n, str)}
        self._fns: dict[str, Callable] = {}
        self.sums: dict[str, torch.Tensor] = {}

    def _add(self, key: str, value: torch.Tensor) -> None:
        value = value.detach().double()
        self.sums[key] = self.sums[key] + value if key in self.sums else value

    def add(self, output: torch.Tensor, target: torch.Tensor, loss: torch.Tensor,
            weight: float = 1.0) -> None:
        """One batch's contribution: the model's output, the target, the batch's mean loss
        (weight 0: a padding batch that only keeps collectives in step across ranks)."""
        output = fitted(output, target, self.task)
        count = target.numel() if self.task == "language_model" else target.shape[0]
        self._add("count", torch.tensor(float(count * weight), device=self.device))
        self._add("loss", one_number(loss, "the loss", self.device) * count * weight)
        if "accuracy" in self.names:
            self._add("correct", (output.argmax(-1) == target).sum() * weight)
        if "mse" in self.names or "r2" in self.names:
            y = target.double()
            self._add("sse", ((output.double() - y) ** 2).sum() * weight)
            self._add("y", y.sum() * weight)
            self._add("yy", (y * y).sum() * weight)
        for name, node in self.custom.items():
            if name not in self._fns:
                from trainers.pytorch.config import locate

                self._fns[name] = locate(node["_target_"])
            value = self._fns[name](output, target)
            self._add(name, one_number(value, f"metric {name!r}", self.device) * count * weight)

    def add_means(self, loss: torch.Tensor, metrics: Mapping[str, Any], count: int,
                  weight: float = 1.0) -> None:
        """A step function's (loss, {metric: mean}) for a batch of ``count`` samples."""
        self._add("count", torch.tensor(float(count * weight), device=self.device))
        self._add("loss", one_number(loss, "the loss", self.device) * count * weight)
        for name, value in metrics.items():
            self._add(f"mean:{name}", one_number(value, f"its metric {name!r}", self.device)
                      * count * weight)

    def reduce(self, all_reduce: Callable[[torch.Tensor], None] | None) -> dict[str, float]:
        """Add every rank's sums (one all-reduce), then the metrics, named test_<metric>."""
        if not self.sums:  # no held-out rows on any rank (every rank has the same batches)
            return {}
        keys = sorted(self.sums)
        stacked = torch.stack([self.sums[k] for k in keys])
        if all_reduce is not None:
            all_reduce(stacked)
        total = dict(zip(keys, stacked.tolist(), strict=True))
        n = max(total.pop("count"), 1e-12)
        loss = total.pop("loss") / n
        out: dict[str, float] = {}
        # A metric whose sums were not kept is left out: a step function gives the loss and
        # its own means only, not the output that accuracy, mse, r2 or a metric fn need (the
        # driver's trial refuses such a metric when trainer.metrics names it).
        for name in self.names:
            if name == "loss":
                out["test_loss"] = loss
            elif name == "perplexity":
                out["test_perplexity"] = math.exp(min(loss, 700.0))
            elif name == "accuracy" and "correct" in total:
                out["test_accuracy"] = total["correct"] / n
            elif name == "mse" and "sse" in total:
                out["test_mse"] = total["sse"] / n
            elif name == "r2" and "sse" in total:
                spread = total["yy"] - total["y"] ** 2 / n
                out["test_r2"] = 1.0 - total["sse"] / spread if spread > 0 else 0.0
            elif name in total:
                out[f"test_{name}"] = total[name] / n
        for key, value in total.items():
            if key.startswith("mean:"):
                out[f"test_{key[5:]}"] = value / n
        return out
