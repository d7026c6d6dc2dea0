"""NaN is not success: NaN, inf or missing values in parquet data stop the command on the
driver (exit 2, one line naming data.path and the count) unless data.allow_nonfinite; a NaN
or inf training loss stops the PyTorch trainer's loop, naming the step, unless
trainer.allow_nonfinite_loss. In-process, no Ray."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir

from orchestrator.cli import CONF_DIR
from orchestrator.config.typed import to_typed
from orchestrator.data import nonfinite
from orchestrator.driver.run_plan import complete_data
from orchestrator.errors import ConfigError
from trainers.pytorch.finite_loss import LossWatch, NonFiniteLoss


def completed(*overrides: str):
    """The driver's completion of data.* (as `python -m orchestrator` does before Ray)."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        node = compose("config", overrides=list(overrides))
    cfg = to_typed(node)
    complete_data(node, cfg)
    return node


@pytest.fixture
def dirty(tmp_path):
    """2000 rows; 40 NaNs in one feature, 3 infs in another, 2 nulls in a third (a NaN that
    pandas wrote), as a user's export might have."""
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=2000), rng.normal(size=2000)
    a[rng.choice(2000, 40, replace=False)] = np.nan
    b[:3] = np.inf
    c = pa.array([None, None, *rng.normal(size=1998)], pa.float64())
    path = tmp_path / "dirty.parquet"
    pq.write_table(pa.table({"a": a, "b": b, "c": c, "y": a.copy()}), path)
    return str(path)


def test_nonfinite_parquet_values_are_refused_by_the_driver_naming_the_path_and_count(dirty):
    with pytest.raises(ConfigError) as err:
        completed("data=parquet", f"data.path={dirty}", "data.label=y", "data.task=regression")
    message = str(err.value)
    assert message.startswith(f"data.path={dirty!r}: 85 missing, NaN or infinite values "
                              "(40 in 'a', 40 in 'y', 3 in 'b' and 1 more column)"), message
    assert "data.allow_nonfinite=true" in message and "\n" not in message
    # Allowed for features (a boosting trainer takes NaN as missing), never for the label:
    # XGBoost failed on every worker ("Label contains NaN"), LightGBM reported test_rmse nan.
    with pytest.raises(ConfigError, match=r"^data.label='y': 40 rows of data.path=.* have a "
                       r"missing, NaN or infinite label"):
        completed("data=parquet", f"data.path={dirty}", "data.label=y",
                  "data.task=regression", "data.allow_nonfinite=true")
    table = pq.read_table(dirty)
    clean_label = dirty.replace("dirty", "clean-label")
    pq.write_table(table.set_column(3, "y", pa.array(np.arange(2000.0))), clean_label)
    node = completed("data=parquet", f"data.path={clean_label}", "data.label=y",
                     "data.task=regression", "data.allow_nonfinite=true")
    assert (node.data.features, node.data.outputs) == (3, 1)


def test_clean_parquet_passes_and_large_data_is_left_to_the_workers(tmp_path, monkeypatch):
    clean = tmp_path / "clean.parquet"
    pq.write_table(pa.table({"a": [1.0, 2.0, 3.0], "n": [1, 2, 3], "label": [0, 1, 0]}), clean)
    assert completed("data=parquet", f"data.path={clean}").data.features == 2
    dataset = pads.dataset(pa.table({"a": [np.nan, 1.0], "label": [0, 1]}))
    assert nonfinite.nonfinite_counts(dataset, ["a", "label"]) == {"a": 1}
    monkeypatch.setattr(nonfinite, "MAX_VALUES", 3)  # 2 rows x 2 columns: too many to read
    assert nonfinite.nonfinite_counts(dataset, ["a", "label"]) is None


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # cuda: the deferred path (no GPU needed)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_loss_stops_the_loop_naming_the_step_unless_allowed(device, bad):
    watch = LossWatch(False, torch.device(device))
    for step in range(1, 5):
        watch.see(step, torch.tensor(1.0 / step))
    watch.check()
    assert NonFiniteLoss.retry is False  # the failure policy stops the run at once
    with pytest.raises(NonFiniteLoss, match=rf"^the training loss is {bad} at step 5: stopped"):
        watch.see(5, torch.tensor(bad))  # on the CPU: at once
        watch.see(6, torch.tensor(-bad))  # on a device: the first bad step is kept
        watch.see(7, torch.tensor(0.5))
        watch.check()  # where the loop waits anyway (a checkpoint, an evaluation, the end)
    allowed = LossWatch(True, torch.device(device))
    allowed.see(1, torch.tensor(bad))
    allowed.check()


def test_the_key_that_allows_a_nonfinite_loss_is_part_of_the_trainers_schema():
    from orchestrator.worker.training_function import check_training

    model = {"_target_": "trainers.pytorch.models.MLP", "in_features": 64, "out_features": 10}
    digits = {"name": "digits", "task": "classification", "features": 64, "outputs": 10}
    training = check_training({"fn": "trainers.pytorch.train:main", "model": model}, digits)
    assert training.config["allow_nonfinite_loss"] is False
    training = check_training({"fn": "trainers.pytorch.train:main", "model": model,
                               "allow_nonfinite_loss": True}, digits)
    assert training.config["allow_nonfinite_loss"] is True


class NaNItems(torch.utils.data.Dataset):
    """A user's dataset whose first item has a NaN feature."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        return torch.tensor([float("nan") if index == 0 else 1.0, 2.0]), torch.tensor(index % 2)


def test_the_trial_refuses_nonfinite_values_in_the_first_items_of_a_users_dataset():
    import dataclasses

    from orchestrator.config.schema import DataConfig
    from orchestrator.worker.training_function import check_training

    items = {"_target_": "tests.test_nonfinite.NaNItems"}
    data = dataclasses.asdict(DataConfig(name="torch", train=items, eval=items))
    trainer = {"fn": "trainers.pytorch.train:main",
               "model": {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 2}}
    with pytest.raises(ConfigError,
                       match=r"^data.train: items 0 and 1 hold 1 non-finite value \(NaN or inf\)"):
        check_training(trainer, data)
    check_training(trainer, {**data, "allow_nonfinite": True})
