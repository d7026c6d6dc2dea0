"""trainer=tf_ps's config and its checks before Ray starts (the model is built once on the
driver: a builder that fails says so here, in one line, not on a server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from orchestrator.config.rules import require
from orchestrator.errors import ConfigError, one_line
from trainers.mwms.config import MWMSConfig
from trainers.neural import check_builder


@dataclass
class TFPSConfig(MWMSConfig):
    """MWMS's keys (the model, its builder's signature, the optimizer), run asynchronously."""

    name: str = "tf_ps"
    fn: str = "trainers.tf_ps.train:main"
    backend: str = "tensorflow_ps"
    ps: int = 1  # parameter servers (the workers: cluster.workers)
    # Closures scheduled ahead, per worker: enough that none waits for the coordinator
    in_flight: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.ps >= 1, "trainer.ps", self.ps,
                "an integer >= 1 (the parameter servers that hold the variables)")
        require(self.in_flight >= 1, "trainer.in_flight", self.in_flight, "an integer >= 1")


def fixed_size(trainer: dict, cluster: dict, given: set) -> dict:
    """The workers are cluster.workers, all of them: a lost one comes back, so the run has no
    smaller size to shrink to (cluster.min_workers is refused)."""
    if cluster.get("min_workers") is not None:
        raise ConfigError(f"cluster.min_workers={cluster['min_workers']} is not allowed with "
                          "trainer=tf_ps: its workers are cluster.workers, and a lost one comes "
                          "back while the others train on; leave cluster.min_workers null")
    if int(cluster.get("workers") or 0) < 1:
        raise ConfigError(f"cluster.workers={cluster.get('workers')} is not allowed with "
                          "trainer=tf_ps: an integer >= 1 (the workers that run the steps)")
    return {}


def check_tf_ps(cfg: dict) -> list[str]:
    """The data it trains on (held in memory by every worker), and the model built once on
    this machine and run on two rows: a builder that raises, or gives no tf.keras model, is
    refused before any server starts. Returns the metrics the run reports."""
    data, trainer = cfg["data"], cfg["trainer"]
    if data.get("name") == "torch":
        raise ConfigError("data=torch is not allowed with trainer=tf_ps: its data is tabular "
                          "(digits, synthetic, parquet)")
    task = data.get("task") or "classification"
    model = trainer["model"]
    check_builder(model)
    features, outputs = data.get("features"), data.get("outputs")
    if features and outputs:
        try_model(model, int(features), int(outputs))
    held_out = ["test_loss"] + (["test_accuracy"] if task == "classification" else [])
    return ["loss", *held_out]


def try_model(model: dict, features: int, outputs: int) -> None:
    """Build the model and run it on two rows, in a process of its own: TensorFlow's start-up
    lines (absl's, on stderr) and its seconds stay out of the command's process."""
    request = json.dumps({"model": model, "features": features, "outputs": outputs})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or "." for p in sys.path)}
    done = subprocess.run([sys.executable, "-m", "trainers.tf_ps.model_trial", request],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = one_line(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "")
        raise ConfigError(f"trainer.model._target_={model['_target_']!r}: trying the model on "
                          f"the driver failed (exit {done.returncode}): {tail[:300]}")
    problem = json.loads(lines[-1]).get("problem")
    if problem:
        raise ConfigError(problem)
