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


IGNORED = -100  # torch's cross entropy ignores targets of this class (ignore_index)


def predicted_classes(output: torch.Tensor, target: torch.Tensor, threshold: float) -> torch.Tensor:
    """The class of each sample: the largest of one output per class, or, for one output a
    row (a binary classifier's), whether it is above ``threshold`` (0 for a logit, 0.5 for a
    probability)."""
    if output.dim() == target.dim() + 1 and output.shape[-1] > 1:
        return output.argmax(-1)
    if output.numel() != target.numel():
        return output.argmax(-1)  # a shape the metric cannot read: it will not match
    return (output.reshape(target.shape) > threshold).to(target.dtype)


def column_sums(total: dict[str, float]) -> list[dict[str, float]]:
    """{"sse:0": .., "y:0": .., "yy:0": .., "sse:1": ..} -> [{"sse", "y", "yy"} per column]."""
    columns = sum(1 for key in total if key.startswith("sse:"))
    return [{part: total[f"{part}:{j}"] for part in ("sse", "y", "yy")} for j in range(columns)]


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
    if task == "regression" and isinstance(output, torch.Tensor) and \
            output.shape != target.shape and output.numel() == target.numel():
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
            weight: float = 1.0, threshold: float = 0.0) -> None:
        """One batch's contribution: the model's output, the target, the batch's mean loss
        (weight 0: a padding batch that only keeps collectives in step across ranks).
        ``threshold``: where one output a row (a binary classifier's) turns into class 1."""
        if not isinstance(output, torch.Tensor) and (set(self.names) - {"loss", "perplexity"}):
            raise TypeError(
                f"the model's output is a {type(output).__name__}, not a tensor (nor has it "
                f"logits), and trainer.metrics={sorted(set(self.names) - {'perplexity'})} read "
                "it: give trainer.metrics=[loss], or a trainer.step_fn that returns (loss, "
                "{metric: value})")
        output = fitted(output, target, self.task)
        # Targets the loss ignores (cross entropy's -100: padding tokens) are not samples: its
        # mean is over the others, and accuracy counts only them.
        counted = target != IGNORED if not target.is_floating_point() else None
        if self.task == "regression":
            count = float(target.shape[0])
        else:
            count = float(counted.sum()) if counted is not None else float(target.numel())
        self._add("count", torch.tensor(count * weight, device=self.device))
        # A batch of nothing but ignored targets has a NaN mean loss: it adds 0 (the key all
        # the same: every rank's sums are stacked by their keys for one all-reduce).
        self._add("loss", one_number(loss, "the loss", self.device) * count * weight if count
                  else torch.zeros((), dtype=torch.float64, device=self.device))
        if "accuracy" in self.names:
            correct = predicted_classes(output, target, threshold) == target
            self._add("correct", (correct if counted is None else correct & counted).sum() * weight)
        if "mse" in self.names or "r2" in self.names:
            # Per target column (a model with several outputs a row): mse over every value,
            # r2 the columns' mean, as scikit-learn's.
            y = target.double().reshape(target.shape[0], -1)
            sse = ((output.double().reshape(y.shape) - y) ** 2).sum(0)
            for j in range(y.shape[1]):
                self._add(f"sse:{j}", sse[j] * weight)
                self._add(f"y:{j}", y[:, j].sum() * weight)
                self._add(f"yy:{j}", (y[:, j] * y[:, j]).sum() * weight)
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
            elif name == "mse" and "sse:0" in total:
                columns = column_sums(total)
                out["test_mse"] = sum(c["sse"] for c in columns) / (n * len(columns))
            elif name == "r2" and "sse:0" in total:
                scores = []
                for c in column_sums(total):
                    spread = c["yy"] - c["y"] ** 2 / n
                    scores.append(1.0 - c["sse"] / spread if spread > 0 else 0.0)
                out["test_r2"] = sum(scores) / len(scores)
            elif name in total:
                out[f"test_{name}"] = total[name] / n
        for key, value in total.items():
            if key.startswith("mean:"):
                out[f"test_{key[5:]}"] = value / n
        return out
