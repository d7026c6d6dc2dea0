"""MWMS, XGBoost and LightGBM end to end on real Ray, checkpointing to a real S3 server
(SeaweedFS): train, checkpoint, resume (after a SIGKILL, or asked for more), read back,
exactness, quality, and no secret in anything the runs wrote or printed."""

from __future__ import annotations

import io
import os
import signal
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.config.schema import DataConfig
from orchestrator.data.datasets import load_dataset
from orchestrator.storage.location import Credentials, StorageSpec
from tests.conftest import finish_run, read_record, run_cli, start_run, wait_for

DIGITS = load_dataset(DataConfig(name="digits"), seed=0)


def s3(server, prefix: str) -> list[str]:
    return ["storage=s3", f"storage.uri=s3://ckpt-tests/{prefix}",
            f"storage.endpoint={server.endpoint}"]


def s3_env(server) -> dict:
    return {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}


def profile_env(server, folder: Path) -> dict:
    """No keys in the environment: a profile in a credentials file instead (what SSO or an
    assumed role leave), which the driver and every worker read through the AWS chain."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "credentials"
    path.write_text(f"[ckpt]\naws_access_key_id = {server.access_key}\n"
                    f"aws_secret_access_key = {server.secret_key}\n")
    path.chmod(0o600)
    return {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_PROFILE": "ckpt",
            "AWS_SHARED_CREDENTIALS_FILE": str(path), "AWS_EC2_METADATA_DISABLED": "true"}


def final_files(server, uri: str) -> dict[str, bytes]:
    spec = StorageSpec(uri, server.endpoint, "us-east-1",
                       Credentials(server.access_key, server.secret_key))
    store = CheckpointStore(spec)
    return store.load(store.latest())[0]


def assert_succeeded(result, trainer: str, workers: int = 2) -> dict:
    assert result.returncode == 0, result.output[-4000:]
    rec = result.record
    assert rec["status"] == "succeeded" and rec["trainer"] == trainer
    assert rec["world_sizes"][-1]["size"] == workers
    assert rec["checkpoints"] and rec["checkpoints"][-1]["step"] == rec["steps"]
    return rec


def assert_no_secret(server, results) -> None:
    """The secret key string is in no file the runs wrote, nor in what they printed."""
    for result in results:
        for path in result.run_dir.rglob("*"):
            if path.is_file():
                assert server.secret_key.encode() not in path.read_bytes(), path
        assert server.secret_key not in result.output


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
    if trainer == "xgboost":
        import xgboost as xgb

        from trainers.xgboost.loop import booster_params

        params = booster_params(config, DIGITS.num_classes, 0)
        booster = xgb.train(params, xgb.DMatrix(DIGITS.x_train, label=DIGITS.y_train), rounds)
        proba = booster.predict(xgb.DMatrix(DIGITS.x_test))
    else:
        import lightgbm as lgb

        from trainers.lightgbm.loop import booster_params

        params = booster_params(config, DIGITS.num_classes, 0)
        booster = lgb.train(params, lgb.Dataset(DIGITS.x_train, label=DIGITS.y_train), rounds)
        proba = booster.predict(DIGITS.x_test)
    return float((np.asarray(proba).argmax(1) == DIGITS.y_test).mean())


@pytest.mark.parametrize("trainer", ["xgboost", "lightgbm"])
def test_boosting_resumes_from_s3_at_its_round_and_matches_one_uninterrupted_run(
        ray_head, s3_server, bucket, tmp_path, trainer):
    common = [f"cluster.address={ray_head.address}", *s3(s3_server, f"boost-{trainer}"),
              f"trainer={trainer}", "checkpoint.every_steps=5", "checkpoint.keep=0",
              "cluster.cpus_per_worker=0.5"]
    env = s3_env(s3_server)
    # The uninterrupted run goes alongside the split one (each takes half the head's CPUs).
    straight = start_run(tmp_path / "b", *common, "run.name=straight",
                         "trainer.num_boost_round=50", env=env)
    first = run_cli(tmp_path / "a1", *common, "run.name=split", "trainer.num_boost_round=20", env=env)
    rec = assert_succeeded(first, trainer)
    assert [c["step"] for c in rec["checkpoints"]] == [5, 10, 15, 20]
    assert rec["checkpoints"][-1]["uri"] == f"s3://ckpt-tests/boost-{trainer}/split/step_000000020"
    assert all(c["bytes"] > 0 and c["upload_s"] > 0 for c in rec["checkpoints"])

    # The same run asked for 50 rounds reads round 20 back from S3 and continues from there,
    # its credentials from a profile: the workers read and write S3 through the AWS chain.
    resumed = run_cli(tmp_path / "a2", *common, "run.name=split", "trainer.num_boost_round=50",
                      env=profile_env(s3_server, tmp_path / "aws"))
    rec = assert_succeeded(resumed, trainer)
    assert rec["resumed_from_step"] == 20 and rec["world_sizes"][0]["step"] == 20
    assert rec["steps"] == 50 and rec["checkpoints"][0]["step"] == 25

    straight = finish_run(straight, tmp_path / "b")
    assert_succeeded(straight, trainer)
    uri = f"s3://ckpt-tests/boost-{trainer}"
    split_pred = booster_predictions(trainer, final_files(s3_server, f"{uri}/split"))
    straight_pred = booster_predictions(trainer, final_files(s3_server, f"{uri}/straight"))
    assert np.abs(split_pred - straight_pred).max() <= 1e-6

    # Quality: far above chance (10 classes), and as good as one process on the same data.
    accuracy = rec["metrics"]["test_accuracy"]
    assert accuracy > 0.93, rec["metrics"]
    assert abs(accuracy - single_process_accuracy(trainer, 50)) <= 0.01
    results = [first, resumed, straight]
    if trainer == "xgboost":
        # A completed run's command again: one line, no worker, the finished run's metrics.
        again = run_cli(tmp_path / "c", *common, "run.name=straight", "trainer.num_boost_round=50",
                        env=env)
        assert again.returncode == 0, again.output[-4000:]
        assert "run straight finished at step 50 on " in again.output
        assert "asking Ray for" not in again.output
        assert again.record["status"] == "already_finished" and again.record["metrics"] == \
            straight.record["metrics"]
        results.append(again)
    assert_no_secret(s3_server, results)


def test_mwms_with_a_users_keras_model_survives_a_killed_worker_exactly(
        ray_head, s3_server, bucket, tmp_path):
    """A user's own Keras model under MultiWorkerMirroredStrategy on parquet streamed from S3
    (each worker reads only its share of the row groups, through the storage's endpoint and
    credentials), checkpointing to S3: a worker SIGKILLed after the first checkpoint; the
    restart resumes there, mid-epoch, and ends with weights and optimizer state equal bit for
    bit to an uninterrupted run's."""
    local = tmp_path / "digits.parquet"
    write_digits_parquet(local, row_group_size=100)
    pafs.copy_files(str(local), f"{bucket}/mwms-data/digits.parquet",
                    source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=s3_server.filesystem())
    data = f"s3://{bucket}/mwms-data/digits.parquet"
    common = [f"cluster.address={ray_head.address}", *s3(s3_server, "mwms"), "trainer=mwms",
              "data=parquet", f"data.path={data}", "data.label=digit", "data.stream=true",
              "trainer.model._target_=tests.user_models.tiny_keras_model", "~trainer.model.hidden",
              "+trainer.model.width=32", "trainer.epochs=100", "trainer.max_steps=300",
              "checkpoint.every_steps=100", "checkpoint.keep=0", "cluster.cpus_per_worker=0.5"]
    env = s3_env(s3_server)
    autograph = Path(tempfile.gettempdir()).glob  # the workers' node's temporary folder
    autograph_before = set(autograph("__autograph_generated_file*"))
    proc = start_run(tmp_path / "killed", *common, "run.name=killed", env=env)
    # The uninterrupted run goes alongside (each takes half the head's CPUs).
    straight = start_run(tmp_path / "straight", *common, "run.name=straight", env=env)
    rec = wait_for(lambda r: r.get("checkpoints") and len(r.get("workers", [])) == 2,
                   tmp_path / "killed")
    os.kill(rec["workers"][1]["pid"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    # No TensorFlow in the driver (ray_internals/tensorflow_backend.py): none of its absl lines
    assert "absl::InitializeLog" not in out and "oneDNN" not in out, out[-4000:]
    rec = read_record(tmp_path / "killed")
    assert rec["status"] == "succeeded" and rec["restarts"] == 1
    assert [w["size"] for w in rec["world_sizes"]] == [2, 2]
    resumed_at = rec["world_sizes"][1]["step"]
    assert resumed_at >= 100 and resumed_at in [c["step"] for c in rec["checkpoints"]]
    assert 0 <= rec["lost_steps"] <= 100
    assert rec["config"]["trainer"]["model"] == {"_target_": "tests.user_models.tiny_keras_model",
                                                 "width": 32}
    assert rec["metrics"]["test_accuracy"] > 0.9, rec["metrics"]
    facts = rec["data"]
    assert facts["streamed"] and facts["row_groups"] == 18, facts
    epochs = 300 / facts["steps_per_epoch"]
    for rank, read in facts["ranks"].items():  # about half the bytes an epoch, each rank
        assert read["bytes_read"] < 1.25 / 2 * facts["bytes"] * (epochs + 2), (rank, read)

    straight = finish_run(straight, tmp_path / "straight")
    assert straight.returncode == 0, straight.output[-4000:]
    assert rec["metrics"] == straight.record["metrics"]
    a = final_files(s3_server, "s3://ckpt-tests/mwms/killed")
    b = final_files(s3_server, "s3://ckpt-tests/mwms/straight")
    for name in ("model.npz", "optimizer.npz"):
        x, y = np.load(io.BytesIO(a[name])), np.load(io.BytesIO(b[name]))
        assert all(np.array_equal(x[k], y[k]) for k in x.files), f"{name} differs"
    assert_no_secret(s3_server, [straight])
    # TensorFlow's converted functions went to each worker's folder, and went with it.
    assert not set(autograph("__autograph_generated_file*")) - autograph_before


def write_digits_parquet(path, label="digit", row_group_size=None) -> None:
    x = np.concatenate([DIGITS.x_train, DIGITS.x_test])
    y = np.concatenate([DIGITS.y_train, DIGITS.y_test])
    columns = {f"px{i}": x[:, i] for i in range(x.shape[1])}
    pq.write_table(pa.table({**columns, label: y}), path, row_group_size=row_group_size)


def test_xgboost_on_parquet(ray_head, tmp_path):
    """Streamed (data.stream=true): each worker sketches its own row groups into a
    QuantileDMatrix in pages on its local disk (trainer.external_memory), and the held-out
    metrics are sums over the workers' own test rows. Paths relative to the user's folder
    (the README's data.path=train.parquet): the workers run elsewhere, so the driver passes
    them on absolute."""
    (tmp_path / "digits").mkdir()
    write_digits_parquet(tmp_path / "digits" / "part-0.parquet", row_group_size=200)
    import threading

    # The pages go in each worker's own folder on its node's disk (ctx.local_dir), which goes
    # when the worker ends (or, killed, with the next worker there): seen while the run goes.
    node_disk = Path(tempfile.gettempdir())
    folders_before, pages, done = set(node_disk.glob("orchestrator-rank*")), set(), threading.Event()

    def watch() -> None:
        while not done.wait(0.02):
            pages.update(node_disk.glob("orchestrator-rank*/local/xgb-extmem-*/cache*"))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = run_cli(tmp_path / "run", f"cluster.address={ray_head.address}", "storage.uri=ckpt",
                         "trainer=xgboost", "data=parquet", "data.path=digits", "data.stream=true",
                         "trainer.external_memory=true", "data.label=digit", cwd=tmp_path)
    finally:
        done.set()
        watcher.join()
    rec = assert_succeeded(result, "xgboost")
    assert {p.parts[-4][:len("orchestrator-rank") + 1] for p in pages} == {
        "orchestrator-rank0", "orchestrator-rank1"}, pages  # each rank's own
    assert not set(node_disk.glob("orchestrator-rank*")) - folders_before  # removed with them
    assert rec["config"]["data"]["path"] == str(tmp_path / "digits")
    assert rec["checkpoint_uri"].startswith(str(tmp_path / "ckpt"))
    assert rec["config"]["data"]["task"] == "classification"  # integer labels: inferred
    assert rec["config"]["data"]["outputs"] == 10 and rec["config"]["data"]["features"] == 64
    assert rec["metrics"]["test_accuracy"] > 0.9, rec["metrics"]


def test_lightgbm_learns_a_regression_from_streamed_parquet(ray_head, tmp_path):
    """Streamed (data.stream=true): each worker holds only its own row groups' training rows,
    its histogram bins forced to the driver's (quantiles of a sample, the same at any world
    size: every split of the model is at one of them), and the held-out metrics add up the
    workers' sums over their own test rows."""
    import lightgbm as lgb

    from orchestrator.data.datasets import synthetic
    from orchestrator.data.streaming import plan_stream

    x, y = synthetic(20000, 16, 0, seed=3, task="regression")
    data = tmp_path / "regression.parquet"
    pq.write_table(pa.table({**{f"x{i}": x[:, i] for i in range(16)}, "label": y}), data,
                   row_group_size=1000)
    bins_before = set(Path(tempfile.gettempdir()).glob("lgb-bins-*"))  # the workers' local disk
    result = run_cli(tmp_path / "run", f"cluster.address={ray_head.address}",
                     f"storage.uri={tmp_path / 'ckpt'}", "trainer=lightgbm", "data=parquet",
                     f"data.path={data}", "data.stream=true", "data.task=regression")
    rec = assert_succeeded(result, "lightgbm")
    assert rec["train_metrics"].keys() == {"train_l2"}, rec["train_metrics"]
    # Measured R^2 0.85 for the same 50 rounds in one process on data=synthetic.
    assert rec["metrics"]["test_r2"] > 0.75 and rec["metrics"]["test_rmse"] > 0, rec["metrics"]
    assert not set(Path(tempfile.gettempdir()).glob("lgb-bins-*")) - bins_before  # removed

    plan = plan_stream(DataConfig(name="parquet", path=str(data), stream="true"),
                       StorageSpec(str(data)), seed=rec["config"]["seed"], trainer=None,
                       workers=2, global_batch=None, task="regression", resumed=None)
    final = Path(rec["checkpoint_uri"])
    booster = lgb.Booster(model_file=str(next(final.rglob("model.txt"))))
    splits: dict[int, set[float]] = {}

    def walk(node: dict) -> None:
        if "split_feature" in node:
            splits.setdefault(node["split_feature"], set()).add(node["threshold"])
            walk(node["left_child"])
            walk(node["right_child"])

    for tree in booster.dump_model()["tree_info"]:
        walk(tree["tree_structure"])
    assert splits, "the model has no split"
    for feature, thresholds in splits.items():
        bounds = np.array(plan.bin_bounds[feature])
        off = [t for t in thresholds if not np.isclose(bounds, t, rtol=1e-9, atol=1e-30).any()
               and abs(t) > 1e-30]
        assert not off, (feature, off[:5], bounds[:5])
