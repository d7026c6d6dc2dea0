"""The DDP trainer end to end on real Ray: 16 workers sharing the two cores of a running
cluster, with a user's model (the default job on an embedded Ray: tests/test_observe.py;
interrupt and resume: tests/test_pytorch_trainer.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.storage.location import StorageSpec
from tests.conftest import finish_run, run_cli, start_run

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


@pytest.mark.slow
def test_sixteen_workers_share_two_cores_on_a_running_cluster_with_a_users_model(ray_head, tmp_path):
    """cluster.address=auto joins the cluster RAY_ADDRESS names; 16 workers get a fractional
    share of its 2 CPUs each; the model is the user's own (a module in tests/, switched in on
    the command line as docs/pytorch.md shows): it gets its width and, because its signature
    asks for them, the data's widths, not the default MLP's keys."""
    result = run_cli(tmp_path / "run", f"storage.uri={tmp_path / 'ckpt'}", "cluster.address=auto",
                     "cluster.workers=16", "trainer.max_steps=30", "checkpoint.every_steps=10",
                     "trainer.model._target_=tests.user_models.TinyTorchNet",
                     "+trainer.model.width=48", env={"RAY_ADDRESS": ray_head.address})
    rec = assert_trained(result, workers=16, min_accuracy=0.5)
    assert rec["steps"] == 30
    assert "{'CPU': 0.12} * 16" in result.output  # the automatic fractional share
    state = final_model(tmp_path / "ckpt", rec["run_name"])
    assert state["0.weight"].shape == (48, 64) and state["2.weight"].shape == (10, 48)
    # It joined the running head (its dashboard) instead of starting a Ray of its own.
    assert ray_head.dashboard.split("//")[1] in result.output
    assert "Started a local Ray" not in result.output


@pytest.mark.slow
def test_a_users_compiled_model_trains_under_ddp_and_fsdp(ray_head, tmp_path):
    """torch.compile in the user's model factory: the workers run torch's own compiler
    (no stand-in where user code runs), DDP and FSDP wrap the compiled module, and what is
    trained and checkpointed is that module."""
    from orchestrator.ray_internals.versions import SPEED_HOOKS
    from trainers.pytorch.dcp_reading import read_metadata_file

    common = [f"storage.uri={tmp_path / 'ckpt'}", f"cluster.address={ray_head.address}",
              "cluster.workers=2", "trainer.max_steps=40", "checkpoint.every_steps=40",
              "trainer.model._target_=tests.user_models.compiled_tiny_net", "~trainer.model.hidden"]
    # FSDP's run also as on a Ray or torch outside the tested range: every speed hook off
    # (ray_internals/versions.py), the fork server and Ray Train's own actors included.
    procs = {kind: start_run(tmp_path / kind, f"trainer={kind}", f"run.name={kind}", *common,
                             env={SPEED_HOOKS: "0"} if kind == "fsdp" else None)
             for kind in ("ddp", "fsdp")}
    results = {kind: finish_run(proc, tmp_path / kind) for kind, proc in procs.items()}
    for result in results.values():
        assert result.returncode == 0, result.output[-4000:]
        rec = result.record
        assert rec["status"] == "succeeded" and rec["steps"] == 40, rec
        assert rec["metrics"]["test_accuracy"] > 0.5, rec["metrics"]
    assert "_orig_mod.0.weight" in final_model(tmp_path / "ckpt", "ddp")
    # FSDP's checkpoint names them as the module does (torch's state-dict helpers drop the
    # compiled wrapper's prefix): it resumes compiled or not
    (metadata,) = (tmp_path / "ckpt" / "fsdp").glob("step_*/**/.metadata")
    keys = set(read_metadata_file(metadata).state_dict_metadata)
    assert {"model.0.weight", "model.2.weight"} <= keys and not any("_orig_mod" in k for k in keys)
