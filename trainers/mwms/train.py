"""MultiWorkerMirroredStrategy as a training function, with a custom training step.

Each worker feeds its shard of the global batch to strategy.run; the per-example losses are
summed and divided by the global batch, and MWMS sums gradients across workers, so the update
is the mean gradient over the global batch whatever the number of workers. Variables are
mirrored, so rank 0 alone writes them into a checkpoint.
"""

from __future__ import annotations

import tempfile

import numpy as np
from hydra.utils import instantiate

from orchestrator.worker_api import WorkerContext, training_function
from trainers.mwms.config import MWMSConfig, check_mwms
from trainers.neural import (
    NonFiniteLoss,
    held_out_sums,
    not_tf_keras,
    standardize,
    stop_message,
    total_steps,
)


def optimizer_variables(optimizer) -> list:
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def save_arrays(path, arrays: list[np.ndarray]) -> None:
    with open(path, "wb") as f:
        np.savez(f, *arrays)


def load_arrays(path) -> list[np.ndarray]:
    with np.load(path, allow_pickle=False) as npz:  # a checkpoint is data: no pickled objects
        return [npz[f"arr_{i}"] for i in range(len(npz.files))]


class InMemory:
    """The dataset held whole (ctx.dataset()): this rank's rows of each global batch, and
    held-out metrics over every test row (every rank has them all)."""

    def __init__(self, ctx: WorkerContext, batch_size: int):
        data = ctx.dataset()
        self.num_features, self.num_classes = data.num_features, data.num_classes
        self.x_train, self.x_test = standardize(data.x_train, data.x_test)
        self.y_train, self.y_test = data.y_train, data.y_test
        self.batches = ctx.batches(len(self.y_train), batch_size)

    def steps(self, start: int, total: int):
        for step in range(start, total):
            rows = self.batches.rows(step)
            yield self.x_train[rows], self.y_train[rows]

    def test_sums(self, predict) -> np.ndarray:
        return held_out_sums(predict(self.x_test), self.y_test)

    def add_up(self, sums: np.ndarray) -> np.ndarray:
        return sums


class Streamed:
    """Streamed parquet (ctx.stream()): this rank reads only its share of the row groups, the
    global batch is the same at any world size, and held-out metrics add up every rank's own
    test rows (an all-reduce through the strategy)."""

    def __init__(self, ctx: WorkerContext, cfg: dict, batch_size: int, add_up):
        self.num_features, self.num_classes = int(cfg["data"]["features"]), int(cfg["data"]["outputs"])
        self.batches = ctx.stream(batch_size)
        self.eval_batch, self.add_up = batch_size, add_up

    def steps(self, start: int, total: int):
        for _, x, y in self.batches.read(start, total):
            yield x, y

    def test_sums(self, predict) -> np.ndarray:
        sums = np.zeros(3)
        for x, y, weight in self.batches.eval_batches(self.eval_batch):
            sums += weight * held_out_sums(predict(x), y)  # padding batches weigh 0
        return sums


class NotATfKerasModel(TypeError):
    retry = False  # the same builder gives the same object on every restart


@training_function(config=MWMSConfig, check=check_mwms, streams=True)
def main(ctx: WorkerContext, cfg: dict) -> dict[str, float] | None:
    # TensorFlow's autograph writes each function it converts to a temporary file, removed
    # at interpreter exit, which a Ray worker never reaches: they go to this worker's own
    # folder instead, removed with it (a killed worker's too).
    before, tempfile.tempdir = tempfile.tempdir, str(ctx.local_dir)
    try:
        return train(ctx, cfg)
    finally:
        tempfile.tempdir = before


def train(ctx: WorkerContext, cfg: dict) -> dict[str, float] | None:
    # Imported here, not with the module: the driver checks this function's config without
    # TensorFlow's seconds of start-up and its lines on stderr.
    import tensorflow as tf

    import trainers.mwms  # noqa: F401  (tf-keras before tensorflow)

    tcfg = cfg["trainer"]
    batch_size = int(tcfg["batch_size"])
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    @tf.function
    def all_reduce(sums):
        per_replica = strategy.run(tf.identity, args=(sums,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def add_up(sums: np.ndarray) -> np.ndarray:  # every rank calls it, at the same steps
        return all_reduce(tf.constant(sums)).numpy()

    data = Streamed(ctx, cfg, batch_size, add_up) if ctx.streamed else InMemory(ctx, batch_size)
    tf.keras.utils.set_random_seed(ctx.seed)  # the same initial weights everywhere
    with strategy.scope():
        model = instantiate(dict(tcfg["model"]), in_features=data.num_features,
                            num_classes=data.num_classes, _convert_="all")
        if not isinstance(model, tf.keras.Model):  # Keras 3's (import keras) is another class
            raise NotATfKerasModel(not_tf_keras(tcfg["model"]["_target_"], model))
        if tcfg["optimizer"] == "sgd":
            optimizer = tf.keras.optimizers.SGD(tcfg["lr"], momentum=tcfg["momentum"])
        else:
            optimizer = tf.keras.optimizers.Adam(tcfg["lr"])
        optimizer.build(model.trainable_variables)
    if (path := ctx.restore(["model.npz", "optimizer.npz"])) is not None:
        model.set_weights(load_arrays(path / "model.npz"))
        for variable, value in zip(optimizer_variables(optimizer),
                                   load_arrays(path / "optimizer.npz"), strict=True):
            variable.assign(value)
    ctx.total_steps = total_steps(tcfg, data.batches.steps_per_epoch)
    step_rows = data.batches.rows_a_step  # all of data smaller than one global batch

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            per_example = tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            loss = tf.reduce_sum(per_example) / step_rows
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return tf.reduce_sum(per_example)

    @tf.function
    def train_step(x, y):
        per_replica = strategy.run(replica_step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def write(folder) -> None:
        # Read on every rank: a BatchNormalization's moving statistics are ON_READ variables,
        # whose read is an all-reduce over the workers (rank 0 alone would pair its read with
        # the others' next gradient all-reduce).
        weights = model.get_weights()
        slots = [v.numpy() for v in optimizer_variables(optimizer)]
        if ctx.rank == 0:
            save_arrays(folder / "model.npz", weights)
            save_arrays(folder / "optimizer.npz", slots)

    def evaluate() -> dict[str, float]:
        correct, loss, rows = data.add_up(data.test_sums(
            lambda x: model(x, training=False).numpy()))
        return {"test_accuracy": correct / max(rows, 1), "test_loss": loss / max(rows, 1)}

    steps = data.steps(ctx.start_step, ctx.total_steps)
    for step, (x, y) in zip(range(ctx.start_step, ctx.total_steps), steps, strict=True):
        loss = float(train_step(tf.constant(x), tf.constant(y))) / step_rows
        if not (np.isfinite(loss) or tcfg["allow_nonfinite_loss"]):
            raise NonFiniteLoss(stop_message(step + 1, loss))
        ctx.step_done(step + 1, {"loss": loss}, samples=step_rows)
        if ctx.should_evaluate(step + 1):
            ctx.eval_done(step + 1, evaluate())
        if ctx.should_save(step + 1):
            ctx.save(step + 1, write)
        if ctx.should_preempt():
            return None
    return evaluate()
