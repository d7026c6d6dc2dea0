"""MultiWorkerMirroredStrategy behind the Trainer interface, with a custom training step.

Each worker feeds its shard of the global batch to strategy.run; the per-example losses are
summed and divided by the global batch, and MWMS sums gradients across workers, so the update
is the mean gradient over the global batch whatever the number of workers. Variables are
mirrored, so rank 0 alone saves them.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf
from hydra.utils import instantiate

import trainers.mwms  # noqa: F401  (tf-keras before tensorflow)
from orchestrator.trainer_api import Trainer
from trainers.neural import check_model_target, standardize, total_steps


def pack(arrays: list[np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, *arrays)
    return buf.getvalue()


def unpack(data: bytes) -> list[np.ndarray]:
    with np.load(io.BytesIO(data)) as npz:
        return [npz[f"arr_{i}"] for i in range(len(npz.files))]


def optimizer_variables(optimizer) -> list:
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class MWMSTrainer(Trainer):
    @classmethod
    def ray_trainer_class(cls) -> type:
        from ray.train.tensorflow import TensorflowTrainer

        return TensorflowTrainer

    @classmethod
    def worker_env(cls) -> dict[str, str]:
        return {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> None:
        check_model_target(config)

    def setup(self, data) -> int:
        cfg, s = self.config, self.session
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy()
        tf.keras.utils.set_random_seed(s.seed)  # the same initial weights everywhere
        with self.strategy.scope():
            self.model = instantiate(dict(cfg["model"]), in_features=data.num_features,
                                     num_classes=data.num_classes, _convert_="all")
            if cfg["optimizer"] == "sgd":
                self.optimizer = tf.keras.optimizers.SGD(cfg["lr"], momentum=cfg["momentum"])
            else:
                self.optimizer = tf.keras.optimizers.Adam(cfg["lr"])
            self.optimizer.build(self.model.trainable_variables)
        self.x_train, self.x_test = standardize(data.x_train, data.x_test)
        self.y_train, self.y_test = data.y_train, data.y_test
        self.batch_size = int(cfg["batch_size"])
        self.order = s.data_order(len(self.y_train), self.batch_size)
        return total_steps(cfg, self.order.steps_per_epoch)

    def _replica_step(self, x, y):
        with tf.GradientTape() as tape:
            logits = self.model(x, training=True)
            per_example = tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            loss = tf.reduce_sum(per_example) / self.batch_size
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))
        return tf.reduce_sum(per_example)

    @tf.function
    def _step(self, x, y):
        per_replica = self.strategy.run(self._replica_step, args=(x, y))
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def train(self, start_step: int) -> None:
        s = self.session
        for step in range(start_step, s.total_steps):
            rows = self.order.shard(step, s.rank, s.world_size)
            loss_sum = self._step(tf.constant(self.x_train[rows]), tf.constant(self.y_train[rows]))
            s.step_done(step + 1, {"loss": float(loss_sum) / self.batch_size},
                        samples=self.batch_size)

    def save(self) -> dict[str, bytes]:
        return {"model.npz": pack(self.model.get_weights()),
                "optimizer.npz": pack([v.numpy() for v in optimizer_variables(self.optimizer)])}

    def load(self, files: Mapping[str, bytes]) -> None:
        self.model.set_weights(unpack(files["model.npz"]))
        for variable, value in zip(optimizer_variables(self.optimizer),
                                   unpack(files["optimizer.npz"]), strict=True):
            variable.assign(value)

    def evaluate(self) -> dict[str, float]:
        logits = self.model(self.x_test, training=False).numpy()
        shifted = logits - logits.max(1, keepdims=True)
        log_proba = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
        return {
            "test_accuracy": float((logits.argmax(1) == self.y_test).mean()),
            "test_loss": float(-log_proba[np.arange(len(self.y_test)), self.y_test].mean()),
        }
