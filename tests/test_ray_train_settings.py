"""What the orchestrator changes in Ray Train's defaults, to cost less than Ray Train alone."""

from __future__ import annotations


def test_runs_without_datasets_start_no_dataset_manager():
    from ray.train.v2._internal.callbacks import DatasetsCallback

    from orchestrator.launch import without_dataset_manager

    class FakeTrainer:
        datasets: dict = {}

        def _create_default_callbacks(self):
            return [DatasetsCallback.__new__(DatasetsCallback), "other"]

    trainer = FakeTrainer()
    without_dataset_manager(trainer)
    assert trainer._create_default_callbacks() == ["other"]
    with_data = FakeTrainer()
    with_data.datasets = {"train": object()}
    without_dataset_manager(with_data)
    assert len(with_data._create_default_callbacks()) == 2


def test_controller_polls_every_second_unless_the_user_says(monkeypatch):
    from orchestrator.launch import controller_env
    from trainers.xgboost.trainer import XGBoostTrainer

    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)
    assert controller_env(30.0, XGBoostTrainer)["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "1"
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")
    assert controller_env(30.0, XGBoostTrainer)["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "2"
