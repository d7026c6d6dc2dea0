"""What the two neural-network trainers (DDP, MWMS) share, framework-free: the config fields
of a global-batch training loop, the check of the model's import path, and the feature scaling."""

from __future__ import annotations

import ast
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from orchestrator.config.rules import require
from orchestrator.config.schema import TrainerConfig
from orchestrator.errors import ConfigError


@dataclass
class NeuralNetConfig(TrainerConfig):
    OPTIMIZERS: ClassVar[tuple[str, ...]] = ("sgd", "adam")
    model: dict[str, Any] = field(default_factory=dict)  # _target_ plus its keyword arguments
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    batch_size: int = 64  # the global batch: the same whatever the number of workers
    epochs: int = 10
    max_steps: int | None = None  # stop earlier than epochs * steps_per_epoch

    def __post_init__(self) -> None:
        require(self.optimizer in self.OPTIMIZERS, "trainer.optimizer", self.optimizer,
                "one of " + ", ".join(self.OPTIMIZERS))
        require(math.isfinite(self.lr) and self.lr > 0, "trainer.lr", self.lr, "a number > 0")
        require(self.batch_size >= 1, "trainer.batch_size", self.batch_size, "an integer >= 1")
        require(self.epochs >= 1, "trainer.epochs", self.epochs, "an integer >= 1")
        if self.max_steps is not None:
            require(self.max_steps >= 1, "trainer.max_steps", self.max_steps,
                    "null or an integer >= 1")
        require("_target_" in self.model, "trainer.model._target_", None,
                "the import path of the model class or builder function")


def check_model_target(cfg: Mapping[str, Any]) -> None:
    """The data's task (classification), and the model's builder (check_builder)."""
    if cfg["data"].get("task") not in (None, "classification"):
        raise ConfigError(f"data.task={cfg['data']['task']!r} is not allowed with this trainer: "
                          "classification")
    check_builder(cfg["trainer"]["model"])


def check_builder(model: Mapping[str, Any]) -> None:
    """The model's builder must exist and take the keys given with it, checked from its
    source without importing it (no framework on the driver)."""
    target = model["_target_"]
    module, _, name = target.rpartition(".")
    if not module:
        raise ConfigError(f"trainer.model._target_={target!r}: an import path, module.function "
                          "(mypkg.models.cnn)")
    try:
        spec = find_spec(module)
    except ModuleNotFoundError:  # its parent package is missing
        spec = None
    if spec is None:
        raise ConfigError(f"trainer.model._target_={target!r}: no module {module!r} to import")
    given = [k for k in model if k != "_target_" and not k.startswith("_")]
    check_builder_source(spec.origin, name, target, ["in_features", "num_classes", *given])


def check_builder_source(origin: str | None, name: str, target: str, passed: list[str]) -> None:
    """The function (or class) ``name`` of a module's source takes these keyword arguments:
    a default model's `hidden` left beside a builder of your own, or a misspelled name, said
    here and not as a TypeError on every worker after its start. Where the source does not
    say (a re-exported name, a compiled module), nothing is refused."""
    try:
        tree = ast.parse(Path(origin).read_text()) if origin and origin.endswith(".py") else None
    except (OSError, SyntaxError, ValueError):
        tree = None
    if tree is None:
        return
    found = {node.name: node for node in tree.body
             if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    defined = {target.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
               for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
               if isinstance(target, ast.Name)}
    imported = any(isinstance(node, (ast.Import, ast.ImportFrom)) and
                   any((a.asname or a.name).split(".")[0] in (name, "*") for a in node.names)
                   for node in tree.body)
    if name not in found:
        if name not in defined and not imported:
            raise ConfigError(f"trainer.model._target_={target!r}: {origin} defines no {name!r}")
        return
    node = found[name]
    if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef)
                     and n.name == "__init__"), None)
        if init is None:
            return  # its parents' __init__
        args, skip = init.args, 1  # self
    else:
        args, skip = node.args, 0
    if args.kwarg is not None:
        return
    names = {a.arg for a in [*args.posonlyargs[skip:], *args.args[skip:], *args.kwonlyargs]}
    unknown = [key for key in passed if key not in names]
    if unknown:
        extra = [k for k in unknown if k not in ("in_features", "num_classes")]
        fix = (f"; drop {', '.join(f'trainer.model.{k}' for k in extra)} with ~ "
               f"(~trainer.model.{extra[0]})" if extra else
               ": it is called as " + target + "(in_features=..., num_classes=..., **keys)")
        raise ConfigError(f"trainer.model._target_={target!r} takes no "
                          f"{', '.join(map(repr, unknown))}{fix}")


def not_tf_keras(target: str, built: object) -> str:
    """The refusal of a model builder that gave no tf.keras.Model (Keras 3's is another class)."""
    return (f"trainer.model._target_={target!r} gave a {type(built).__module__}."
            f"{type(built).__name__}, not a tf.keras.Model: build it with tf.keras (import "
            "tensorflow as tf; tf.keras.Sequential(...)), not Keras 3's `import keras`")


def held_out_sums(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(correct, summed loss, rows) of some held-out rows: sums add up over the ranks."""
    shifted = logits - logits.max(1, keepdims=True)
    log_proba = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
    y = np.asarray(y, dtype=np.int64)
    return np.array([float((logits.argmax(1) == y).sum()),
                     float(-log_proba[np.arange(len(y)), y].sum()), float(len(y))])


def standardize(train: np.ndarray, *others: np.ndarray) -> list[np.ndarray]:
    """Scale by the training rows' mean and spread; constant columns are left as they are."""
    mean, std = train.mean(0), train.std(0)
    std = np.where(std < 1e-6, 1.0, std).astype(np.float32)
    return [((x - mean) / std).astype(np.float32) for x in (train, *others)]


def total_steps(config: Mapping[str, Any], steps_per_epoch: int) -> int:
    total = int(config["epochs"]) * steps_per_epoch
    return min(total, int(config["max_steps"])) if config.get("max_steps") else total


class NonFiniteLoss(RuntimeError):
    retry = False  # a restart replays the same data to the same NaN: the run stops at once


def stop_message(step: int, value: float) -> str:
    return (f"the training loss is {value} at step {step}: stopped there (every later step "
            "would be NaN); look for NaN or inf in the data, or lower trainer.lr; "
            "trainer.allow_nonfinite_loss=true trains on regardless")
