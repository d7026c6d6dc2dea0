"""MultiWorkerMirroredStrategy as a training function, with a custom training step.

Each worker feeds its shard of the global batch to strategy.run; the per-example losses are
summed and divided by the global batch, and MWMS sums gradients across workers, so the update
is the mean gradient over the global batch whatever the number of workers. Variables are
mirrored, so rank 0 alone writes them into a checkpoint.
"""

from __future__ import annotations

import numpy as np
from hydra.utils import instantiate

from orchestrator.worker_api import WorkerContext, training_function
from trainers.mwms.config import MWMSConfig
from trainers.neural import check_model_target, standardize, total_steps


def optimizer_variables(optimizer) -> list:
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def save_arrays(path, arrays: list[np.ndarray]) -> None:
    with open(path, "wb") as f:
        np.savez(f, *arrays)


def load_arrays(path) -> list[np.ndarray]:
    with np.load(path, allow_pickle=False) as npz:  # a checkpoint is data: no pickled objects
        return [npz[f"arr_{i}"] for i in range(len(npz.files))]


@training_function(config=MWMSConfig, check=check_model_target)
def main(ctx: WorkerContext, cfg: dict) -> dict[str, float] | None:
    # Imported here, not with the module: the driver checks this function's config without
    # TensorFlow's seconds of start-up and its lines on stderr.
    import tensorflow as tf

    import trainers.mwms  # noqa: F401  (tf-keras before tensorflow)

    tcfg = cfg["trainer"]
    data = ctx.dataset()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    tf.keras.utils.set_random_seed(ctx.seed)  # the same initial weights everywhere
    with strategy.scope():
        model = instantiate(dict(tcfg["model"]), in_features=data.num_features,
                            num_classes=data.num_classes, _convert_="all")
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
    x_train, x_test = standardize(data.x_train, data.x_test)
    y_train, y_test = data.y_train, data.y_test
    batch_size = int(tcfg["batch_size"])
    batches = ctx.batches(len(y_train), batch_size)
    ctx.total_steps = total_steps(tcfg, batches.steps_per_epoch)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            per_example = tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            loss = tf.reduce_sum(per_example) / batch_size
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return tf.reduce_sum(per_example)

    @tf.function
    def train_step(x, y):
        per_replica = strategy.run(replica_step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def write(folder) -> None:
        if ctx.rank == 0:
            save_arrays(folder / "model.npz", model.get_weights())
            save_arrays(folder / "optimizer.npz",
                        [v.numpy() for v in optimizer_variables(optimizer)])

    def evaluate() -> dict[str, float]:
        logits = model(x_test, training=False).numpy()
        shifted = logits - logits.max(1, keepdims=True)
        log_proba = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
        return {"test_accuracy": float((logits.argmax(1) == y_test).mean()),
                "test_loss": float(-log_proba[np.arange(len(y_test)), y_test].mean())}

    for step in range(ctx.start_step, ctx.total_steps):
        rows = batches.rows(step)
        loss_sum = train_step(tf.constant(x_train[rows]), tf.constant(y_train[rows]))
        ctx.step_done(step + 1, {"loss": float(loss_sum) / batch_size}, samples=batch_size)
        if ctx.should_evaluate(step + 1):
            ctx.eval_done(step + 1, evaluate())
        if ctx.should_save(step + 1):
            ctx.save(step + 1, write)
        if ctx.should_preempt():
            return None
    return evaluate()
