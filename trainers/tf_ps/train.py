"""Parameter-server training's coordinator: the one process Ray Train runs. It starts the
servers (servers.py), builds the model under ParameterServerStrategy (its variables live on
the parameter servers), and schedules one closure a step: a worker takes the next one free,
reads its own batch, and applies its gradients to the variables at once, without waiting for
the others (asynchronous). A step is one update: ``optimizer.iterations`` counts them.

Checkpoints (tf.train.Checkpoint of model and optimizer) are written by the coordinator once
the closures in flight are done, through the same commit as every trainer; a restart reads
the newest one back into fresh servers and goes on from its iterations.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np
from hydra.utils import instantiate

from orchestrator.worker_api import WorkerContext, training_function
from trainers.neural import NonFiniteLoss, held_out_sums, standardize, stop_message, total_steps
from trainers.tf_ps.config import TFPSConfig, check_tf_ps, fixed_size
from trainers.tf_ps.servers import ParameterServers, ServerLost

POLL_S = 0.05  # how often the coordinator reads the step count while closures run
CHECKPOINT = "ckpt"  # tf.train.Checkpoint's prefix: ckpt.index, ckpt.data-*


def cpus_each(cluster: dict, servers: int) -> float:
    """cluster.cpus_per_worker, else the CPUs the coordinator leaves split among workers and
    servers (all of them must fit: a server that cannot be placed would be waited for)."""
    from orchestrator.driver.scaling import MIN_CPU_SHARE, cpu_share

    given = cluster.get("cpus_per_worker")
    return float(given) if given else cpu_share(float(cluster["cpus"]) - MIN_CPU_SHARE, servers)


@training_function(config=TFPSConfig, check=check_tf_ps, cluster=fixed_size, coordinates=True,
                   warm_imports=())
def main(ctx: WorkerContext, cfg: dict) -> dict[str, float] | None:
    # TensorFlow's autograph writes the functions it converts to temporary files, removed at
    # interpreter exit, which a Ray worker never reaches: this worker's own folder instead.
    before, tempfile.tempdir = tempfile.tempdir, str(ctx.local_dir)
    try:
        workers, ps = int(cfg["cluster"]["workers"]), int(cfg["trainer"]["ps"])
        with ParameterServers(workers, ps, cpus_each(cfg["cluster"], workers + ps)) as servers:
            return Coordinator(ctx, cfg, servers).train()
    finally:
        tempfile.tempdir = before


class Coordinator:
    def __init__(self, ctx: WorkerContext, cfg: dict, servers: ParameterServers):
        import tensorflow as tf

        import trainers.tf_ps  # noqa: F401  (tf-keras before tensorflow)

        self.tf, self.ctx, self.servers = tf, ctx, servers
        self.report()  # before the first announcement: its words for the workers
        tcfg = self.tcfg = cfg["trainer"]
        data = ctx.dataset()
        self.regression = data.num_classes == 0
        x_train, self.x_test = standardize(data.x_train, data.x_test)
        y_train, self.y_test = data.y_train, data.y_test
        if self.regression:
            y_train = np.asarray(y_train, np.float32).reshape(-1, 1)
            self.y_test = np.asarray(self.y_test, np.float32).reshape(-1, 1)
        self.batch_size = int(tcfg["batch_size"])
        steps_per_epoch = -(-len(y_train) // self.batch_size)
        ctx.total_steps = total_steps(tcfg, steps_per_epoch)
        strategy = servers.strategy
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        tf.keras.utils.set_random_seed(ctx.seed)
        with strategy.scope():
            self.model = instantiate(dict(tcfg["model"]), in_features=data.num_features,
                                     num_classes=1 if self.regression else data.num_classes,
                                     _convert_="all")
            if tcfg["optimizer"] == "sgd":
                self.optimizer = tf.keras.optimizers.SGD(tcfg["lr"], momentum=tcfg["momentum"])
            else:
                self.optimizer = tf.keras.optimizers.Adam(tcfg["lr"])
            self.optimizer.build(self.model.trainable_variables)
            # Summed on a parameter server by every closure: the loss between two reports
            self.loss_sum = tf.Variable(0.0, dtype=tf.float64, trainable=False)
            self.loss_count = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer)
        if (path := ctx.restore()) is not None:
            self.checkpoint.read(str(path / CHECKPOINT)).assert_consumed()
        self.step_fn = self.make_step(x_train, y_train)

    def make_step(self, x_train: np.ndarray, y_train: np.ndarray):
        tf, model, optimizer = self.tf, self.model, self.optimizer
        batch_size, regression = self.batch_size, self.regression
        loss_sum, loss_count = self.loss_sum, self.loss_count

        def dataset_fn():
            # Each worker holds the rows and shuffles them its own way: asynchronous steps
            # come in no fixed order anyway.
            rows = tf.data.Dataset.from_tensor_slices((x_train, y_train))
            return rows.shuffle(len(x_train)).repeat().batch(batch_size).prefetch(2)

        self.batches = iter(self.coordinator.create_per_worker_dataset(dataset_fn))

        def replica_step(x, y):
            with tf.GradientTape() as tape:
                out = model(x, training=True)
                if regression:
                    loss = tf.reduce_mean(tf.square(out - y))
                else:
                    loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                        y, out, from_logits=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            loss_sum.assign_add(tf.cast(loss, tf.float64))
            loss_count.assign_add(1)
            return loss

        @tf.function
        def step(iterator):
            x, y = next(iterator)
            return self.coordinator.strategy.run(replica_step, args=(x, y))

        return step

    # -- the loop ------------------------------------------------------------------------
    def train(self) -> dict[str, float] | None:
        ctx, total = self.ctx, self.ctx.total_steps
        in_flight = int(self.tcfg["in_flight"]) * len(self.servers.spec["worker"])
        step = scheduled = self.reported = self.iterations()
        self.loss_seen = (float(self.loss_sum.numpy()), int(self.loss_count.numpy()))
        self.report()
        try:
            while step < total:
                while scheduled - step < in_flight and scheduled < total:
                    self.coordinator.schedule(self.step_fn, args=(self.batches,))
                    scheduled += 1
                time.sleep(POLL_S)
                now = self.iterations()
                if now == step:
                    self.check_servers()
                    continue
                save = any(ctx.should_save(s) for s in range(step + 1, now + 1))
                evaluate = any(ctx.should_evaluate(s) for s in range(step + 1, now + 1))
                step = self.step_done(step, now)
                if save or ctx.should_preempt():
                    step = self.save()
                if ctx.should_preempt():
                    return None
                if evaluate and step < total:
                    ctx.eval_done(step, self.evaluate())
                self.check_servers()
            self.coordinator.join()
            step = self.step_done(step, self.iterations())
            if ctx.should_save(step):
                self.save()
        except Exception as exc:
            # The lost server that explains it, not TensorFlow's "Connection reset by peer"
            if isinstance(exc, self.tf.errors.OpError) and (why := self.servers.why_lost()):
                raise ServerLost(why) from exc
            raise
        finally:
            self.report()
        return self.evaluate()

    def iterations(self) -> int:
        return int(self.optimizer.iterations.numpy())

    def step_done(self, before: int, step: int) -> int:
        """Report the updates since ``before``, with their mean loss."""
        if step <= before:
            return before
        total, count = float(self.loss_sum.numpy()), int(self.loss_count.numpy())
        seen_total, seen_count = self.loss_seen
        self.loss_seen = (total, count)
        metrics = {}
        if count > seen_count:  # a closure adds its loss just after its update
            metrics["loss"] = loss = (total - seen_total) / (count - seen_count)
            if not (np.isfinite(loss) or self.tcfg["allow_nonfinite_loss"]):
                raise NonFiniteLoss(stop_message(step, loss))
        self.servers.step = self.reported = step
        self.ctx.step_done(step, metrics, samples=(step - before) * self.batch_size)
        return step

    def save(self) -> int:
        """Once the closures in flight are done: the variables as of one step count."""
        self.coordinator.join()
        step = self.step_done(self.reported, self.iterations())
        self.ctx.save(step, lambda folder: self.checkpoint.write(str(folder / CHECKPOINT)))
        return step

    def check_servers(self) -> None:
        if self.servers.lost:
            raise ServerLost(self.servers.lost)
        if self.servers.changed():
            self.report()

    def report(self) -> None:
        self.ctx.report_processes(self.servers.facts())

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics on the coordinator, from the variables as they are now."""
        out = self.model(self.tf.constant(self.x_test), training=False).numpy()
        if self.regression:
            return {"test_loss": float(np.mean((out - self.y_test) ** 2))}
        correct, loss, rows = held_out_sums(out, self.y_test)
        return {"test_accuracy": correct / rows, "test_loss": loss / rows}
