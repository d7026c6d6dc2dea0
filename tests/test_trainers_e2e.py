"""MWMS, XGBoost and LightGBM end to end on real Ray: train, checkpoint, resume, quality."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.config.schema import DataConfig
from orchestrator.data.datasets import load_dataset
from orchestrator.storage import StorageSpec
from tests.conftest import run_cli

DIGITS = load_dataset(DataConfig(name="digits"), seed=0)


def final_files(storage, run_name: str) -> dict[str, bytes]:
    store = CheckpointStore(StorageSpec(str(storage / run_name)))
    return store.load(store.latest())[0]


def assert_succeeded(result, trainer: str, workers: int = 2) -> dict:
    assert result.returncode == 0, result.output[-4000:]
    rec = result.record
    assert rec["status"] == "succeeded" and rec["trainer"] == trainer
    assert rec["world_sizes"][-1]["size"] == workers
    assert rec["checkpoints"] and rec["checkpoints"][-1]["step"] == rec["steps"]
    return rec


def booster_predictions(trainer: str, files: dict[str, bytes]) -> np.ndarray:
    if trainer == "xgboost":
        import xgboost as xgb

        booster = xgb.Booster(model_file=bytearray(files["model.ubj"]))
        return booster.predict(xgb.DMatrix(DIGITS.x_test))
    import lightgbm as lgb

    return lgb.Booster(model_str=files["model.txt"].decode()).predict(DIGITS.x_test)


def single_process_accuracy(trainer: str, rounds: int) -> float:
    """The same parameters and data, trained in this process without Ray."""
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.load(f"conf/trainer/{trainer}.yaml"))
    config.pop("defaults", None)
    if trainer == "xgboost":
        import xgboost as xgb

        from trainers.xgboost.train import booster_params

        params = booster_params({**_xgb_defaults(), **config}, DIGITS.num_classes, 0)
        booster = xgb.train(params, xgb.DMatrix(DIGITS.x_train, label=DIGITS.y_train), rounds)
        proba = booster.predict(xgb.DMatrix(DIGITS.x_test))
    else:
        import lightgbm as lgb

        from trainers.lightgbm.train import booster_params

        params = booster_params({**_lgb_defaults(), **config}, DIGITS.num_classes, 0)
        booster = lgb.train(params, lgb.Dataset(DIGITS.x_train, label=DIGITS.y_train), rounds)
        proba = booster.predict(DIGITS.x_test)
    return float((np.asarray(proba).argmax(1) == DIGITS.y_test).mean())


def _xgb_defaults() -> dict:
    from dataclasses import asdict

    from trainers.xgboost.config import XGBoostConfig

    return asdict(XGBoostConfig())


def _lgb_defaults() -> dict:
    from dataclasses import asdict

    from trainers.lightgbm.config import LightGBMConfig

    return asdict(LightGBMConfig())


@pytest.mark.parametrize("trainer", ["xgboost", "lightgbm"])
def test_boosting_resumes_at_its_round_and_matches_one_uninterrupted_run(ray_head, tmp_path, trainer):
    storage = tmp_path / "ckpt"
    common = [f"cluster.address={ray_head.address}", f"storage.uri={storage}",
              f"trainer={trainer}", "checkpoint.every_steps=5", "checkpoint.keep=0"]
    first = run_cli(tmp_path / "a1", *common, "run.name=split", "trainer.num_boost_round=20")
    rec = assert_succeeded(first, trainer)
    assert [c["step"] for c in rec["checkpoints"]] == [5, 10, 15, 20]

    # The same run asked for 50 rounds continues from round 20, not from zero.
    resumed = run_cli(tmp_path / "a2", *common, "run.name=split", "trainer.num_boost_round=50")
    rec = assert_succeeded(resumed, trainer)
    assert rec["resumed_from_step"] == 20 and rec["world_sizes"][0]["step"] == 20
    assert rec["steps"] == 50 and rec["checkpoints"][0]["step"] == 25

    straight = run_cli(tmp_path / "b", *common, "run.name=straight", "trainer.num_boost_round=50")
    assert_succeeded(straight, trainer)
    split_pred = booster_predictions(trainer, final_files(storage, "split"))
    straight_pred = booster_predictions(trainer, final_files(storage, "straight"))
    assert np.abs(split_pred - straight_pred).max() <= 1e-6

    # Quality: far above chance (10 classes), and as good as one process on the same data.
    accuracy = rec["metrics"]["test_accuracy"]
    assert accuracy > 0.93, rec["metrics"]
    assert abs(accuracy - single_process_accuracy(trainer, 50)) <= 0.01


def test_mwms_trains_checkpoints_and_resumes_at_its_step(ray_head, tmp_path):
    storage = tmp_path / "ckpt"
    common = [f"cluster.address={ray_head.address}", f"storage.uri={storage}", "trainer=mwms",
              "checkpoint.every_steps=20", "checkpoint.keep=0"]
    first = run_cli(tmp_path / "a1", *common, "run.name=split", "trainer.max_steps=60")
    assert assert_succeeded(first, "mwms")["steps"] == 60

    resumed = run_cli(tmp_path / "a2", *common, "run.name=split", "trainer.max_steps=160")
    rec = assert_succeeded(resumed, "mwms")
    assert rec["resumed_from_step"] == 60 and rec["steps"] == 160
    assert rec["metrics"]["test_accuracy"] > 0.9, rec["metrics"]

    straight = run_cli(tmp_path / "b", *common, "run.name=straight", "trainer.max_steps=160")
    assert_succeeded(straight, "mwms")
    a = np.load(io.BytesIO(final_files(storage, "split")["model.npz"]))
    b = np.load(io.BytesIO(final_files(storage, "straight")["model.npz"]))
    diff = max(float(np.abs(a[k] - b[k]).max()) for k in a.files)
    assert diff <= 1e-5, f"resumed MWMS weights differ by {diff}"


def test_mwms_with_a_users_keras_model_on_synthetic_data(ray_head, tmp_path):
    result = run_cli(tmp_path / "run", f"cluster.address={ray_head.address}",
                     f"storage.uri={tmp_path / 'ckpt'}", "trainer=mwms", "data=synthetic",
                     "data.rows=4000", "trainer.model._target_=tests.user_models.tiny_keras_model",
                     "~trainer.model.hidden",
                     "+trainer.model.width=16", "trainer.epochs=3")
    rec = assert_succeeded(result, "mwms")
    assert rec["config"]["trainer"]["model"]["_target_"] == "tests.user_models.tiny_keras_model"
    assert rec["metrics"]["test_accuracy"] > 0.85, rec["metrics"]


def test_ddp_with_a_users_torch_model(ray_head, tmp_path):
    result = run_cli(tmp_path / "run", f"cluster.address={ray_head.address}",
                     f"storage.uri={tmp_path / 'ckpt'}",
                     "trainer.model._target_=tests.user_models.TinyTorchNet", "~trainer.model.hidden",
                     "+trainer.model.width=48")
    rec = assert_succeeded(result, "ddp")
    files = final_files(tmp_path / "ckpt", rec["run_name"])
    import torch

    state = torch.load(io.BytesIO(files["model.pt"]), weights_only=True)
    assert state["0.weight"].shape == (48, 64)  # the user's module, width 48, was trained
    assert rec["metrics"]["test_accuracy"] > 0.9


def write_digits_parquet(path, label="digit") -> None:
    x = np.concatenate([DIGITS.x_train, DIGITS.x_test])
    y = np.concatenate([DIGITS.y_train, DIGITS.y_test])
    columns = {f"px{i}": x[:, i] for i in range(x.shape[1])}
    pq.write_table(pa.table({**columns, label: y}), path)


def test_xgboost_on_parquet(ray_head, tmp_path):
    write_digits_parquet(tmp_path / "digits.parquet")
    result = run_cli(tmp_path / "run", f"cluster.address={ray_head.address}",
                     f"storage.uri={tmp_path / 'ckpt'}", "trainer=xgboost", "data=parquet",
                     f"data.path={tmp_path / 'digits.parquet'}", "data.label=digit")
    rec = assert_succeeded(result, "xgboost")
    assert rec["metrics"]["test_accuracy"] > 0.9, rec["metrics"]


def test_lightgbm_on_synthetic_data(ray_head, tmp_path):
    result = run_cli(tmp_path / "run", f"cluster.address={ray_head.address}",
                     f"storage.uri={tmp_path / 'ckpt'}", "trainer=lightgbm", "data=synthetic",
                     "data.rows=20000")
    rec = assert_succeeded(result, "lightgbm")
    assert rec["metrics"]["test_auc"] > 0.9, rec["metrics"]
