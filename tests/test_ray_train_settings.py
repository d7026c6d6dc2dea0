"""What the orchestrator changes in Ray Train's defaults, to cost less than Ray Train alone."""

from __future__ import annotations


def test_helper_actors_a_run_does_not_need_are_not_started():
    from ray.train.v2._internal.callbacks import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import (
        PlacementGroupCleanerCallback,
    )

    from orchestrator.launch import without_unneeded_actors
    from orchestrator.pg_cleaner import PinnedPlacementGroupCleanerCallback

    class FakeTrainer:
        datasets: dict = {}

        def _create_default_callbacks(self):
            return [DatasetsCallback.__new__(DatasetsCallback),
                    PlacementGroupCleanerCallback(), "other"]

    embedded = FakeTrainer()
    without_unneeded_actors(embedded, embedded=True)
    assert embedded._create_default_callbacks() == ["other"]
    joined = FakeTrainer()
    without_unneeded_actors(joined, embedded=False)  # a shared cluster keeps its cleaner,
    assert [type(cb) for cb in joined._create_default_callbacks()] == [  # pinned to it
        PinnedPlacementGroupCleanerCallback, str]
    with_data = FakeTrainer()
    with_data.datasets = {"train": object()}
    without_unneeded_actors(with_data, embedded=False)
    assert len(with_data._create_default_callbacks()) == 3


def test_controller_polls_every_second_unless_the_user_says(monkeypatch):
    from orchestrator.backends import BACKENDS
    from orchestrator.launch import controller_env

    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)
    assert controller_env(30.0, BACKENDS["xgboost"])["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "1"
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")
    env = controller_env(30.0, BACKENDS["torch"])
    assert env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "2"
    assert env["TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S"] == "2"  # the torch backend's own


def test_the_kept_cleaner_finds_its_own_cluster_and_removes_a_dead_controllers_group(monkeypatch):
    """Every Ray process here sees RAY_ADDRESS pointing at a dead cluster (what a stale
    `ray start` record does to the state API): Ray's own cleaner waits for that cluster's GCS
    and never cleans (this test fails with it); the pinned one asks its own cluster."""
    import time

    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    from orchestrator.pg_cleaner import PinnedPlacementGroupCleaner

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")  # inherited by the raylet's workers
    # The cleaner asks the state API, which the dashboard serves.
    ray.init(address="local", num_cpus=1, include_dashboard=True, dashboard_host="127.0.0.1",
             dashboard_port=0)
    try:
        @ray.remote(num_cpus=0)
        class Controller:
            def ping(self) -> int:
                return 1

        controller = Controller.remote()
        ray.get(controller.ping.remote())
        group = placement_group([{"CPU": 1}])
        ray.get(group.ready(), timeout=30)
        cleaner = ray.remote(num_cpus=0)(PinnedPlacementGroupCleaner).options(
            lifetime="detached").remote(controller_actor_id=controller._actor_id.hex(),
                                        check_interval_s=0.2, get_actor_timeout_s=5,
                                        stop_timeout=10)
        ray.get(cleaner.register_placement_group.remote(group))
        cleaner.start_monitoring.remote()
        time.sleep(1.5)
        assert placement_group_table(group)["state"] == "CREATED"  # its controller lives
        ray.kill(controller)
        deadline = time.time() + 20
        while time.time() < deadline and placement_group_table(group)["state"] != "REMOVED":
            time.sleep(0.2)
        assert placement_group_table(group)["state"] == "REMOVED"
    finally:
        ray.shutdown()
