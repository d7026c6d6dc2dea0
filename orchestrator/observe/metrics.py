"""The run's state as Ray metrics (ray.util.metrics), tagged by run and trainer.

Ray's metrics agent on the recorder's node (the driver's) serves them on its Prometheus
endpoint with a `ray_` prefix (ray_orchestrator_samples_per_s, ...); the Ray dashboard's
metrics views and any Prometheus/Grafana pointed at the cluster read them from there.
"""

from __future__ import annotations

from collections.abc import Mapping

from ray.util.metrics import Gauge, Histogram

from orchestrator.driver.record import RunRecord

TAGS = ("run", "trainer")
SECONDS = [0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0]


class RunMetrics:
    def __init__(self, run: str, trainer: str):
        tags = {"run": run, "trainer": trainer}

        def gauge(name: str, what: str, keys: tuple[str, ...] = TAGS) -> Gauge:
            return Gauge(f"orchestrator_{name}", what, keys).set_default_tags(tags)

        def histogram(name: str, what: str) -> Histogram:
            return Histogram(f"orchestrator_{name}", what, SECONDS, TAGS).set_default_tags(tags)

        self.samples_per_s = gauge("samples_per_s", "Training samples per second (last 10 s)")
        self.step_seconds = gauge("step_seconds", "Seconds per step (last 10 s)")
        self.step = gauge("step", "Steps (or boosting rounds) done")
        self.world_size = gauge("world_size", "Workers in the current worker group")
        # Totals of the run so far, as gauges: they are exported from 0 on, and a run's
        # total is what a dashboard shows (a Ray Counter appears only at its first increment).
        self.restarts = gauge("restarts", "Worker-group restarts after a failure")
        self.preemptions = gauge("preemptions", "Preemption notices acted on")
        self.lost_steps = gauge("lost_steps", "Steps computed twice because of faults")
        self.checkpoint_step = gauge("checkpoint_step", "Step of the newest committed checkpoint")
        self.train_metric = gauge("train_metric", "Latest training metric of rank 0",
                                  (*TAGS, "metric"))
        self.save_s = histogram("checkpoint_save_seconds", "Checkpoint serialise+snapshot time")
        self.upload_s = histogram("checkpoint_upload_seconds", "Checkpoint upload+commit time")
        self._checkpoints_seen: set[int] = set()

    def update(self, record: RunRecord, samples_per_s: float | None,
               step_s: float | None) -> None:
        """Set every gauge (Ray evicts a gauge that is not set again within its TTL)."""
        self.step.set(record.steps)
        if record.world_sizes:
            self.world_size.set(record.world_sizes[-1]["size"])
        self.samples_per_s.set(samples_per_s)
        self.step_seconds.set(step_s)
        self.restarts.set(record.restarts)
        self.preemptions.set(record.preemptions)
        self.lost_steps.set(record.lost_steps)
        self._train_metrics(record.train_metrics)
        for ckpt in record.checkpoints:
            # Each once; one found at a resume (RunRecord.checkpoint_found) has no timings.
            if ckpt["step"] in self._checkpoints_seen or ckpt["save_s"] is None:
                continue
            self._checkpoints_seen.add(ckpt["step"])
            self.save_s.observe(ckpt["save_s"])
            self.upload_s.observe(ckpt["upload_s"])
        if record.checkpoints:
            self.checkpoint_step.set(record.checkpoints[-1]["step"])

    def _train_metrics(self, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self.train_metric.set(float(value), tags={"metric": name})
