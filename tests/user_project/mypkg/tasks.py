"""One small dataset, model and step function per task, with items as tuples or as dicts: the
combinations a user's first project takes (tests/test_pytorch_tasks.py tries them all)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

FEATURES, CLASSES, VOCAB, LENGTH = 4, 3, 11, 6
# Dict items name their parts as a user would: the trainer finds input and target by name.
KEYS = {"classification": ("image", "label"), "regression": ("inputs", "target"),
        "language_model": ("input_ids", "labels")}


class Items(Dataset):
    """Seeded items: (features, class), (features, number) or (tokens, next tokens); form
    "weighted" adds a sample weight as a third part."""

    def __init__(self, task: str, form: str = "tuple", size: int = 24, seed: int = 0):
        self.task, self.form = task, form
        g = torch.Generator().manual_seed(seed)
        if task == "language_model":
            ids = torch.randint(0, VOCAB, (size, LENGTH + 1), generator=g)
            self.x, self.y = ids[:, :-1], ids[:, 1:]
        else:
            self.x = torch.randn(size, FEATURES, generator=g)
            score = self.x @ torch.arange(1.0, FEATURES + 1)
            self.y = score if task == "regression" else score.argsort().argsort() % CLASSES

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        if self.form == "dict":
            x, y = KEYS[self.task]
            return {x: self.x[index], y: self.y[index]}
        if self.form == "weighted":
            return self.x[index], self.y[index], torch.tensor(1.0)
        return self.x[index], self.y[index]


class Net(nn.Module):
    """Logits over classes, one number, or logits over the vocabulary at every position."""

    def __init__(self, task: str):
        super().__init__()
        if task == "language_model":
            self.net = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))
        else:
            self.net = nn.Linear(FEATURES, 1 if task == "regression" else CLASSES)

    def forward(self, x):
        return self.net(x)


def step(model, batch, task: str, with_metrics: bool = False):
    """A user's step function: the batch's mean loss, and with_metrics its own mean metric."""
    x, y = (batch[k] for k in KEYS[task]) if isinstance(batch, dict) else batch
    out = model(x)
    if task == "regression":
        out = out.squeeze(-1)
        loss, metrics = F.mse_loss(out, y), {"mae": (out - y).abs().mean()}
    else:
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        metrics = {"accuracy": (out.argmax(-1) == y).float().mean()}
    return (loss, metrics) if with_metrics else loss


@dataclass
class Batch:
    """A batch as an object of the user's own, made by their collate function."""

    x: torch.Tensor
    y: torch.Tensor


def collate_as_batch(items) -> Batch:
    return Batch(torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]))


def batch_step(model, batch: Batch):
    out = model(batch.x)
    return F.cross_entropy(out, batch.y), {"accuracy": (out.argmax(-1) == batch.y).float().mean()}


class Output:
    """A model output object, as a Hugging Face model returns: the logits as an attribute."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits


class OutputNet(Net):
    def forward(self, x):
        return Output(self.net(x))


def output_loss(output: Output, target):
    return F.cross_entropy(output.logits, target)
