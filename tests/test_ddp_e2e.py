"""The DDP trainer end to end on real Ray: the default job, 4 workers, interrupt and resume."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.storage import StorageSpec
from tests.conftest import REPO, cli_command, cli_env, run_cli

DIGITS_TRAIN_ROWS = 1437  # 80% of scikit-learn's 1797 digits


def final_model(storage: Path, run_name: str) -> dict[str, torch.Tensor]:
    store = CheckpointStore(StorageSpec(str(storage / run_name)))
    files, _ = store.load(store.latest())
    return torch.load(__import__("io").BytesIO(files["model.pt"]), weights_only=True)


def assert_trained(result, workers: int, min_accuracy: float = 0.9) -> dict:
    assert result.returncode == 0, result.output[-4000:]
    rec = result.record
    assert rec["status"] == "succeeded" and rec["trainer"] == "ddp"
    assert [w["size"] for w in rec["world_sizes"]] == [workers]
    assert rec["metrics"]["test_accuracy"] > min_accuracy, rec["metrics"]
    assert rec["steps"] > 0 and rec["samples_per_s"] > 0 and rec["time_to_first_step_s"] > 0
    for ckpt in rec["checkpoints"]:
        assert (Path(ckpt["uri"]) / "manifest.json").is_file() or ckpt["step"] < rec["steps"]
    assert rec["checkpoints"][-1]["step"] == rec["steps"]
    return rec


def test_four_workers_on_a_running_cluster_with_a_users_model(ray_head, tmp_path):
    """cluster.address=auto joins the cluster RAY_ADDRESS names; the model is the user's own
    (a module in tests/, switched in on the command line as SPEC.md shows): it gets its width
    and, because its signature asks for them, the data's widths, not the default MLP's keys."""
    result = run_cli(tmp_path / "run", f"storage.uri={tmp_path / 'ckpt'}", "cluster.address=auto",
                     "cluster.workers=4", "trainer.model._target_=tests.user_models.TinyTorchNet",
                     "+trainer.model.width=48", env={"RAY_ADDRESS": ray_head.address})
    rec = assert_trained(result, workers=4)
    state = final_model(tmp_path / "ckpt", rec["run_name"])
    assert state["0.weight"].shape == (48, 64) and state["2.weight"].shape == (10, 48)
    # It joined the running head (its dashboard) instead of starting a Ray of its own.
    assert ray_head.dashboard.split("//")[1] in result.output
    assert "Started a local Ray" not in result.output


@pytest.mark.slow
def test_interrupted_run_resumes_where_it_stopped_and_ends_bit_identical(ray_head, tmp_path):
    storage = tmp_path / "ckpt"
    common = [f"cluster.address={ray_head.address}", f"storage.uri={storage}",
              "trainer.epochs=200", "checkpoint.every_steps=100", "checkpoint.keep=0"]
    total = 200 * (DIGITS_TRAIN_ROWS // 64)

    # 1. Start, wait for the first committed checkpoint, then stop it as a user would (Ctrl-C).
    first = subprocess.Popen(cli_command(tmp_path / "a1", *common, "run.name=stopped"), cwd=REPO,
                             env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    store = CheckpointStore(StorageSpec(str(storage / "stopped")))
    deadline = time.time() + 240
    while store.latest() is None and first.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    first.send_signal(signal.SIGINT)
    out, _ = first.communicate(timeout=120)
    stopped_at = store.latest().step
    assert 0 < stopped_at < total, f"the run was not stopped mid-way ({stopped_at}/{total})\n{out[-2000:]}"

    # 2. The same command again resumes from that checkpoint and finishes.
    resumed = run_cli(tmp_path / "a2", *common, "run.name=stopped")
    rec = resumed.record
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert rec["resumed_from_step"] == stopped_at and rec["world_sizes"][0]["step"] == stopped_at
    assert rec["steps"] == total and f"resuming at step {stopped_at}" in resumed.output

    # 3. It ends with exactly the parameters of a run that never stopped.
    straight = run_cli(tmp_path / "b", *common, "run.name=straight")
    assert straight.returncode == 0, straight.output[-4000:]
    a, b = final_model(storage, "stopped"), final_model(storage, "straight")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume"
    assert rec["metrics"] == straight.record["metrics"]


@pytest.mark.slow
def test_sixteen_workers_share_two_cores(ray_head, tmp_path):
    result = run_cli(tmp_path / "run", f"storage.uri={tmp_path / 'ckpt'}",
                     f"cluster.address={ray_head.address}", "cluster.workers=16",
                     "trainer.max_steps=30", "checkpoint.every_steps=10")
    rec = assert_trained(result, workers=16, min_accuracy=0.5)
    assert rec["steps"] == 30
    assert "{'CPU': 0.12} * 16" in result.output  # the automatic fractional share
