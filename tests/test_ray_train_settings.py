"""What the orchestrator changes in Ray Train's defaults, to cost less than Ray Train alone."""

from __future__ import annotations


def test_helper_actors_a_run_does_not_need_are_not_started():
    from ray.train.v2._internal.callbacks import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import (
        PlacementGroupCleanerCallback,
    )

    from orchestrator.launch import without_unneeded_actors

    class FakeTrainer:
        datasets: dict = {}

        def _create_default_callbacks(self):
            return [DatasetsCallback.__new__(DatasetsCallback),
                    PlacementGroupCleanerCallback(), "other"]

    embedded = FakeTrainer()
    without_unneeded_actors(embedded, embedded=True)
    assert embedded._create_default_callbacks() == ["other"]
    joined = FakeTrainer()
    without_unneeded_actors(joined, embedded=False)  # a shared cluster keeps its cleaner
    assert [type(cb) for cb in joined._create_default_callbacks()] == [
        PlacementGroupCleanerCallback, str]
    with_data = FakeTrainer()
    with_data.datasets = {"train": object()}
    without_unneeded_actors(with_data, embedded=False)
    assert len(with_data._create_default_callbacks()) == 3


def test_controller_polls_every_second_unless_the_user_says(monkeypatch):
    from orchestrator.launch import controller_env
    from trainers.xgboost.trainer import XGBoostTrainer

    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)
    assert controller_env(30.0, XGBoostTrainer)["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "1"
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")
    assert controller_env(30.0, XGBoostTrainer)["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "2"
