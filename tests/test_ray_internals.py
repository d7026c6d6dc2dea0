"""Ray's private hooks, files and environment variables the orchestrator uses
(orchestrator/ray_internals/), checked against the installed Ray itself, not a stand-in: a Ray
upgrade that renames one fails here, naming it, instead of silently costing what it saved."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import socket
import time
from pathlib import Path

import pytest

from tests.helpers import ray_version


def real_trainer(**kwargs):
    from ray.train import ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    return DataParallelTrainer(lambda config: None, scaling_config=ScalingConfig(num_workers=1),
                               **kwargs)


def without_switch(monkeypatch) -> None:
    """No Ray preemption-watcher switch in this process's environment, and none left after
    the test (the hook sets it when fit() would build its callbacks)."""
    from orchestrator.ray_internals import train_hooks
    from orchestrator.ray_internals.knobs import PREEMPTION_WATCHER

    monkeypatch.setenv(PREEMPTION_WATCHER, "")  # recorded as unset, restored so
    monkeypatch.delenv(PREEMPTION_WATCHER)
    monkeypatch.setattr(train_hooks, "_watcher_switched_here", False)


def test_helper_actors_a_run_does_not_need_are_not_started(monkeypatch):
    """Ray Train's real default callbacks, through the hook: the cleaner and the datasets
    callback are there before, gone after (a sweep's trial registers its groups instead)."""
    from ray.train.v2._internal.callbacks import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import (
        PlacementGroupCleanerCallback,
    )

    from orchestrator.ray_internals.pg_cleaner import RegisteredGroupsCallback
    from orchestrator.ray_internals.preemption_watch import PreemptionWatchThread
    from orchestrator.ray_internals.train_hooks import without_unneeded_actors

    def kinds(trainer) -> set[type]:
        return {type(cb) for cb in trainer._create_default_callbacks()}

    without_switch(monkeypatch)

    before = kinds(real_trainer())
    assert {DatasetsCallback, PlacementGroupCleanerCallback} <= before, before
    run = real_trainer()  # a command's run, on an embedded or a joined cluster
    without_unneeded_actors(run, keep_cleaner=False)
    after = kinds(run)
    assert not after & {DatasetsCallback, PlacementGroupCleanerCallback,
                        RegisteredGroupsCallback}, after
    # The rest kept; the preemption watcher runs in the controller (the next test).
    assert after == before - {DatasetsCallback, PlacementGroupCleanerCallback} \
        | {PreemptionWatchThread}
    trial = real_trainer()  # a sweep's trial: its groups registered, for the sweep's driver
    without_unneeded_actors(trial, keep_cleaner=True)
    assert RegisteredGroupsCallback in kinds(trial)
    assert PlacementGroupCleanerCallback not in kinds(trial)


def test_the_preemption_watcher_runs_as_a_thread_and_marks_every_worker_when_its_node_drains(
        monkeypatch):
    """PreemptionWatchThread: Ray's own watcher class, constructed in the controller's process
    for each worker group, polls Ray's draining nodes in a thread of it and tells every worker
    (Ray's actor handles' mark_preempt); stopped with its group. Ray's controller starts its
    own watcher actor unless its switch says not to, which the driver sets with the thread.
    The drain source is the one stand-in (no cluster here); tests/test_preemption.py drains
    real nodes."""
    import threading
    from types import SimpleNamespace

    from ray.train.v2._internal.constants import ENV_VARS_TO_PROPAGATE
    from ray.train.v2._internal.execution import preemption
    from ray.train.v2._internal.execution.controller.controller import TrainController
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from orchestrator.driver.backends import BACKENDS
    from orchestrator.ray_internals import train_hooks
    from orchestrator.ray_internals.knobs import PREEMPTION_WATCHER
    from orchestrator.ray_internals.preemption_watch import PreemptionWatchThread
    from orchestrator.ray_internals.train_hooks import controller_env

    source = inspect.getsource(TrainController.__init__)
    assert "ENABLE_PREEMPTION_WATCHER_ENV_VAR" in source and "PreemptionCallback()" in source
    # The switch goes with the thread: set in the driver where fit() builds its callbacks, just
    # before it starts the controller with the driver's value (Ray Train passes it on).
    assert "callbacks=self._create_default_callbacks()" in inspect.getsource(DataParallelTrainer.fit)
    assert PREEMPTION_WATCHER in ENV_VARS_TO_PROPAGATE
    assert PREEMPTION_WATCHER not in controller_env(30.0, BACKENDS["torch"])
    without_switch(monkeypatch)
    trainer = real_trainer()
    train_hooks.without_unneeded_actors(trainer, keep_cleaner=False)
    assert PREEMPTION_WATCHER not in os.environ  # not before fit() asks for the callbacks
    assert any(type(cb) is PreemptionWatchThread for cb in trainer._create_default_callbacks())
    assert os.environ[PREEMPTION_WATCHER] == "0"
    again = real_trainer()  # this process's next run (a sweep's): still the thread
    train_hooks.without_unneeded_actors(again, keep_cleaner=False)
    assert any(type(cb) is PreemptionWatchThread for cb in again._create_default_callbacks())
    monkeypatch.setattr(train_hooks, "_watcher_switched_here", False)
    monkeypatch.setenv(PREEMPTION_WATCHER, "1")  # the user's own choice: Ray's way
    theirs = real_trainer()
    train_hooks.without_unneeded_actors(theirs, keep_cleaner=False)
    assert not any(type(cb) is PreemptionWatchThread for cb in theirs._create_default_callbacks())
    assert os.environ[PREEMPTION_WATCHER] == "1"

    marked: dict[int, object] = {}
    both = threading.Event()

    class Worker:
        def __init__(self, rank):
            self.mark_preempt = SimpleNamespace(remote=lambda info: (
                marked.__setitem__(rank, info), len(marked) == 2 and both.set()))

    workers = [SimpleNamespace(distributed_context=SimpleNamespace(world_rank=r),
                               metadata=SimpleNamespace(node_id=f"node{r}"), actor=Worker(r))
               for r in (0, 1)]
    drained: dict[str, int] = {}
    monkeypatch.setattr(preemption, "_get_draining_nodes", lambda: dict(drained))
    callback = PreemptionWatchThread()
    callback._poll_interval_s = 0.05
    callback.after_worker_group_start(SimpleNamespace(get_workers=lambda: workers))
    watcher = callback._watcher
    thread = watcher._monitor_thread  # in this process, no actor
    assert thread.is_alive() and thread in threading.enumerate()
    drained["node1"] = 1_700_000_000_000
    assert both.wait(timeout=60), marked
    assert {r: (i.preempted_ranks, i.deadline_ms) for r, i in marked.items()} == \
        {0: ([1], 1_700_000_000_000), 1: ([1], 1_700_000_000_000)}
    callback.before_worker_group_shutdown(None)
    assert callback._watcher is None and watcher._stop_event.is_set()
    thread.join(timeout=60)
    assert not thread.is_alive()


def test_the_sigint_hook_is_what_fit_calls_with_the_controller():
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from orchestrator.ray_internals.train_hooks import interrupted_by_ctrl_c

    source = inspect.getsource(DataParallelTrainer)
    assert "self._register_sigint_handler(controller)" in source
    trainer = real_trainer()
    controller = interrupted_by_ctrl_c(trainer)
    assert trainer._register_sigint_handler is not DataParallelTrainer._register_sigint_handler
    assert controller.handle is None  # known once fit() made it


@pytest.mark.parametrize("names", ["ENV_KNOBS", "CORE_KNOBS"])
def test_every_environment_variable_set_for_ray_is_one_ray_reads(names):
    import ray

    from orchestrator.driver.backends import BACKENDS
    from orchestrator.ray_internals import knobs

    wanted = set(getattr(knobs, names))
    if names == "ENV_KNOBS":
        wanted |= {k for b in BACKENDS.values() for k in b.controller_env}
    root = Path(ray.__file__).parent
    found = {name for path in root.rglob("*.py") for name in wanted
             if name in path.read_text(errors="ignore")} if wanted else set()
    assert found == wanted, wanted - found


def test_every_system_config_key_of_an_embedded_cluster_is_one_rays_raylet_knows():
    """Ray refuses to start with a key it does not know (its GCS exits, ray.init times out):
    a renamed key would fail every embedded command, so it fails here first, by name."""
    import ray

    from orchestrator.ray_internals.knobs import EMBEDDED_SYSTEM_CONFIG

    raylet = (Path(ray.__file__).parent / "core/src/ray/raylet/raylet").read_bytes()
    assert EMBEDDED_SYSTEM_CONFIG
    assert [k for k in EMBEDDED_SYSTEM_CONFIG if k.encode() not in raylet] == []


def test_a_notice_without_deadline_is_held_past_the_deadline_ray_train_gives_it():
    """The workers held 30 s after such a notice, then raised: Ray's controller, waiting 120 s,
    charged that error to failure.max_restarts (a drain could stop a run with exit 1)."""
    from ray.train.v2._internal.constants import DEFAULT_PREEMPTION_DEADLINE_S

    from orchestrator.ray_internals.knobs import NO_DEADLINE_PREEMPTION_S
    from orchestrator.worker.start import WorkerSpec

    assert NO_DEADLINE_PREEMPTION_S == DEFAULT_PREEMPTION_DEADLINE_S
    assert WorkerSpec.__dataclass_fields__["preemption_wait_s"].default > DEFAULT_PREEMPTION_DEADLINE_S


def test_ray_cores_private_helpers_are_there():
    from ray._private.authentication import authentication_token_setup
    from ray._private.authentication.authentication_utils import is_token_auth_enabled
    from ray._private.state import available_resources_per_node

    from orchestrator.ray_internals.cluster import token_auth_enabled

    # Ray 2.59 and later (2.58 joins with RAY_AUTH_MODE set: cluster.use_token_auth_if_available)
    assert callable(getattr(authentication_token_setup,
                            "maybe_enable_token_auth_if_token_available", None)) or \
        ray_version() < (2, 59)
    assert callable(available_resources_per_node) and callable(is_token_auth_enabled)
    assert token_auth_enabled() in (True, False)


def test_the_token_auth_notice_a_sweep_leaves_out_is_logged_where_its_filter_sits():
    """Ray's notice comes from the logger the filter is added to, in the words it drops; the
    filter drops that record and no other."""
    import importlib
    import inspect
    import logging

    from orchestrator.ray_internals.cluster import (
        TOKEN_NOTICE,
        TOKEN_NOTICE_LOGGER,
        NoTokenAuthNotice,
    )

    module = importlib.import_module(TOKEN_NOTICE_LOGGER)
    assert module.logger.name == TOKEN_NOTICE_LOGGER
    # Ray 2.60 prints it; an older Ray has no such notice to leave out
    assert TOKEN_NOTICE in inspect.getsource(module) or ray_version() < (2, 60)

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord(TOKEN_NOTICE_LOGGER, logging.WARNING, "", 0, message, (), None)

    notice = NoTokenAuthNotice()
    assert not notice.filter(record(f"{TOKEN_NOTICE} for this Ray cluster. Set RAY_AUTH_MODE="
                                     "disabled to opt out."))
    assert notice.filter(record("Token authentication is disabled for this Ray cluster."))


def test_ray_start_records_its_address_where_auto_looks():
    import ray.scripts.scripts as ray_cli

    from orchestrator.ray_internals.cluster import CURRENT_CLUSTER_FILE

    text = Path(inspect.getsourcefile(ray_cli)).read_text() + "".join(
        p.read_text(errors="ignore") for p in Path(inspect.getsourcefile(ray_cli)).parents[1]
        .joinpath("_private").glob("*.py"))
    assert CURRENT_CLUSTER_FILE.name in text


def test_controller_polls_every_half_second_unless_the_user_says(monkeypatch):
    from orchestrator.driver.backends import BACKENDS
    from orchestrator.ray_internals.train_hooks import controller_env

    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)
    assert controller_env(30.0, BACKENDS["xgboost"])["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.5"
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")
    env = controller_env(30.0, BACKENDS["torch"])
    assert env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "2"
    assert env["TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S"] == "2"  # the torch backend's own


def test_the_sweeps_driver_removes_the_groups_of_dead_trial_controllers_only(monkeypatch):
    """A sweep's trial controllers register their workers' placement groups; the sweep's
    driver removes those whose controller died (a trial Tune stopped), not a live one's, and
    forgets one its controller removed itself. Every Ray process here sees RAY_ADDRESS
    pointing at a dead cluster (what a stale `ray start` record does to Ray's state API, which
    Ray's own cleaner asked): the GCS is asked directly."""
    import ray
    from ray.experimental import internal_kv
    from ray.util.placement_group import placement_group, placement_group_table

    from orchestrator.ray_internals import pg_cleaner

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")  # inherited by the raylet's workers
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        @ray.remote(num_cpus=0)
        class TrainController:  # makes and registers a group, as a trial's controller does
            def start(self, cpus: float) -> str:
                group = placement_group([{"CPU": cpus}])
                ray.get(group.ready(), timeout=30)
                pg_cleaner.register(group, ray.get_runtime_context().get_actor_id())
                self.group = group
                return group.id.hex()

            def end(self) -> None:  # a run that ended: its controller removed its group
                ray.util.remove_placement_group(self.group)

            def unregistered(self) -> str:  # made as the job ends, before its registration
                group = placement_group([{"CPU": 0.25}])
                ray.get(group.ready(), timeout=30)
                return group.id.hex()

        Controller = TrainController
        stopped, live, ended = Controller.remote(), Controller.remote(), Controller.remote()
        ids = ray.get([stopped.start.remote(0.5), live.start.remote(0.5), ended.start.remote(0.5)])
        ray.get(ended.end.remote())
        assert pg_cleaner.remove_orphaned_groups() == []  # every controller is alive
        ray.kill(stopped)
        ray.kill(ended)
        assert pg_cleaner.remove_orphaned_groups() == [ids[0]]  # the stopped trial's only
        state = {i: placement_group_table(pg_cleaner.group_by_id(i))["state"] for i in ids}
        assert state == {ids[0]: "REMOVED", ids[1]: "CREATED", ids[2]: "REMOVED"}
        left = internal_kv._internal_kv_list(pg_cleaner.key_prefix(), namespace=pg_cleaner.NAMESPACE)
        assert [k.decode().rsplit(":", 1)[1] for k in left] == [ids[1]]  # the live one's entry
        # The sweep's end: once its controllers are gone, nothing its job made stays held.
        late = ray.get(live.unregistered.remote())
        assert pg_cleaner.live_controllers() == [live._actor_id.hex()]
        assert set(pg_cleaner.groups_of_this_job()) == {ids[1], late}
        ray.kill(live)
        assert sorted(pg_cleaner.release_the_jobs_groups(wait_s=60)) == sorted([ids[1], late])
        assert pg_cleaner.groups_of_this_job() == [] and pg_cleaner.live_controllers() == []
        assert internal_kv._internal_kv_list(pg_cleaner.key_prefix(), namespace=pg_cleaner.NAMESPACE) == []
    finally:
        ray.shutdown()


def test_a_run_says_which_hook_a_ray_upgrade_took_away():
    from orchestrator.ray_internals.train_hooks import hooks_missing

    assert hooks_missing(real_trainer()) == []  # the installed Ray has every one

    class Renamed:  # what a trainer class without the hooks would be
        pass

    missing = hooks_missing(Renamed())
    assert [m.split(" (")[1].split(")")[0] for m in missing] == [
        "_register_sigint_handler", "_create_default_callbacks", "_initialize_and_run_controller"]


def test_auto_follows_only_a_cluster_file_of_this_users_own(tmp_path, monkeypatch):
    """/tmp/ray is every user's: a cluster file another user wrote (or may rewrite) would
    have the driver send its Ray token to their address."""
    import os

    from orchestrator.driver import ray_session
    from orchestrator.errors import ConfigError

    recorded = tmp_path / "ray_current_cluster"
    recorded.write_text("10.0.0.5:6379\n")
    recorded.chmod(0o644)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_session, "CURRENT_CLUSTER_FILE", recorded)
    assert ray_session.resolve_address("auto") == "10.0.0.5:6379"

    recorded.chmod(0o664)  # a user-private group's umask: still the user's own
    assert ray_session.resolve_address("auto") == "10.0.0.5:6379"
    recorded.chmod(0o666)
    with pytest.raises(ConfigError, match=r"writable by other users .*mode 666.*not followed"):
        ray_session.resolve_address("auto")
    recorded.chmod(0o644)
    monkeypatch.setattr(os, "getuid", lambda: recorded.stat().st_uid + 1)
    with pytest.raises(ConfigError, match=r"^cluster.address='auto': .* is another user's"):
        ray_session.resolve_address("auto")
    assert ray_session.resolve_address("10.0.0.7:6379") == "10.0.0.7:6379"  # the user said so


def test_a_jobs_placement_groups_go_with_it_so_a_command_needs_no_cleaner(ray_head):
    """Why a command's run starts no PlacementGroupCleaner (train_hooks.without_unneeded_actors):
    a placement group an actor makes, as Ray Train's controller makes its workers', is removed
    when the job (the command's driver) ends, whether the actor died first or not."""
    import subprocess
    import sys
    import time

    from scripts.local_cluster import node_env

    make = ("import ray, os\n"
            "from ray.util.placement_group import placement_group\n"
            f"ray.init(address={ray_head.address!r}, logging_level='ERROR')\n"
            "@ray.remote(num_cpus=0)\n"
            "class Controller:\n"
            "    def reserve(self):\n"
            "        group = placement_group([{'CPU': 0.5}])\n"
            "        ray.get(group.ready(), timeout=60)\n"
            "        return group.id.hex()\n"
            "c = Controller.remote()\n"
            "print(ray.get(c.reserve.remote()))\n"
            "if os.environ.get('KILL'): ray.kill(c)\n")
    look = ("import ray, json\n"
            "from ray.util.placement_group import placement_group_table\n"
            f"ray.init(address={ray_head.address!r}, logging_level='ERROR')\n"
            "print(json.dumps({k: v['state'] for k, v in placement_group_table().items()}))\n")
    groups = []
    for kill in ("", "1"):
        made = subprocess.run([sys.executable, "-c", make], capture_output=True, text=True,
                              env={**node_env(), "KILL": kill}, timeout=120)
        assert made.returncode == 0, made.stderr[-2000:]
        groups.append(made.stdout.split()[-1])
    deadline = time.time() + 30
    while True:
        seen = subprocess.run([sys.executable, "-c", look], capture_output=True, text=True,
                              env=node_env(), timeout=120)
        states = {k[-len(g):]: v for k, v in json.loads(seen.stdout.split("\n")[-2]).items()
                  for g in groups if k.endswith(g)}
        if all(states.get(g) == "REMOVED" for g in groups) or time.time() > deadline:
            break
        time.sleep(1)
    assert all(states.get(g) == "REMOVED" for g in groups), states


def test_a_fixed_size_run_on_an_embedded_cluster_asks_no_autoscaler():
    """without_autoscaling_requests: the policy fit() hands the controller (Ray Train's fixed
    one) is swapped for one that starts no AutoscalingCoordinator, and still decides the same
    size. Real classes of the installed Ray; where fit() makes the policy and where the base
    class starts the coordinator are checked in their source."""
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import (
        ResizeDecision,
        create_scaling_policy,
    )
    from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy
    from ray.train.v2._internal.execution.scaling_policy.scaling_policy import ScalingPolicy
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from orchestrator.ray_internals.train_hooks import without_autoscaling_requests

    assert "scaling_policy=create_scaling_policy(self.scaling_config)" in \
        inspect.getsource(DataParallelTrainer.fit)
    assert "TrainAutoscalingCoordinatorClient(" in inspect.getsource(ScalingPolicy.after_controller_start)
    trainer, given = real_trainer(), {}
    trainer._initialize_and_run_controller = lambda **kwargs: given.update(kwargs)
    without_autoscaling_requests(trainer)
    policy = create_scaling_policy(ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}))
    assert type(policy) is FixedScalingPolicy
    trainer._initialize_and_run_controller(scaling_policy=policy)
    swapped = given["scaling_policy"]
    assert isinstance(swapped, FixedScalingPolicy) and swapped is not policy
    swapped.after_controller_start(None)  # the base class would start the coordinator here
    decision = swapped.make_decision_for_non_running_worker_group()  # it would assert a client
    assert isinstance(decision, ResizeDecision) and decision.num_workers == 2
    swapped.before_controller_abort()


def test_a_permanent_verdict_makes_ray_trains_retry_a_raise_and_nothing_else(monkeypatch):
    """with_permanent_errors_raised: the policy fit() hands the controller is wrapped; Ray
    Train's own decision stands (its counts too) unless it is RETRY and the run's recorder holds
    a permanent verdict. Real classes of the installed Ray; the recorder's answer is given."""
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import (
        FailureDecision,
        create_failure_policy,
    )
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
    from ray.train.v2.api.exceptions import WorkerGroupError

    from orchestrator.ray_internals.failure_decisions import StopOnPermanentErrors
    from orchestrator.ray_internals.train_hooks import with_permanent_errors_raised

    assert "failure_policy=create_failure_policy(self.run_config.failure_config)" in \
        inspect.getsource(DataParallelTrainer.fit)
    trainer, given = real_trainer(), {}
    trainer._initialize_and_run_controller = lambda **kwargs: given.update(kwargs)
    with_permanent_errors_raised(trainer, recorder=None)
    trainer._initialize_and_run_controller(
        failure_policy=create_failure_policy(FailureConfig(max_failures=1)))
    policy = given["failure_policy"]
    assert isinstance(policy, StopOnPermanentErrors)
    verdict = {"permanent": False}
    monkeypatch.setattr(policy, "_verdict_is_permanent", lambda: verdict["permanent"])
    error = WorkerGroupError("rank 0: ValueError", {0: ValueError("bad batch")})
    assert policy.make_decision(error) == FailureDecision.RETRY  # 1 of max_failures=1
    verdict["permanent"] = True
    policy.inner._worker_group_failures = 0
    assert policy.make_decision(error) == FailureDecision.RAISE
    assert policy.make_decision(error) == FailureDecision.RAISE  # Ray Train's own: over the limit


def test_the_torch_backend_leaves_torch_out_of_the_controller_and_calls_rays_own_functions():
    """What Ray Train's controller does with the config (unpickle it, make its backend, read
    its framework and settings) imports no torch, in a fresh process; the worker-side
    functions it calls are Ray's, with the parameters passed here; its settings are Ray's
    TorchConfig's."""
    import pickle
    import subprocess
    import sys

    from ray.train.torch.config import (
        TorchConfig,
        TorchConfigContextManager,
        _set_torch_distributed_env_vars,
        _setup_torch_process_group,
        _shutdown_torch,
    )

    from orchestrator.driver.backends import backend_named
    from orchestrator.ray_internals.torch_backend import TorchProcessGroup, TorchProcessGroupConfig

    config = backend_named("torch").ray_config(30.0, use_gpu=False)
    assert isinstance(config, TorchProcessGroupConfig) and config.backend == "gloo"
    assert backend_named("torch").ray_config(30.0, use_gpu=True).backend == "nccl"
    assert config.to_dict() == TorchConfig(backend="gloo", timeout_s=30).to_dict()
    assert config.framework == TorchConfig().framework
    controller = (
        "import pickle, sys\n"
        "config = pickle.loads(sys.stdin.buffer.read())\n"
        "backend = config.backend_cls()\n"
        "print(backend.share_cuda_visible_devices, config.framework, config.to_dict(),\n"
        "      'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", controller], input=pickle.dumps(config),
                         capture_output=True, check=True).stdout.decode()
    assert out.split()[0] == "True" and out.split()[-1] == "False", out
    # The worker side: Ray's functions take what on_start and on_shutdown pass.
    assert {"backend", "world_rank", "world_size", "init_method", "timeout_s"} <= \
        set(inspect.signature(_setup_torch_process_group).parameters)
    assert "destroy_process_group" in inspect.signature(_shutdown_torch).parameters
    assert callable(_set_torch_distributed_env_vars)
    assert callable(TorchConfigContextManager.__enter__) and TorchProcessGroup.has_replica_groups \
        == TorchConfig().backend_cls.has_replica_groups


def test_the_train_pages_versions_reach_the_controller_as_plain_strings(monkeypatch):
    """With the Train page on, Ray Train's state callback is replaced by one whose question to
    rank 0 is answered in plain strings: Ray's own answer pickles torch's version as torch's
    class (unpickling it in a fresh process, the controller's, imports torch); this one's does
    not, and says the same versions."""
    import pickle
    import subprocess
    import sys

    from ray.train.v2._internal.callbacks.state_manager import StateManagerCallback
    from ray.train.v2._internal.util import TrainingFramework

    from orchestrator.ray_internals import train_page
    from orchestrator.ray_internals.knobs import STATE_TRACKING
    from orchestrator.ray_internals.train_hooks import with_plain_framework_versions

    monkeypatch.setenv(STATE_TRACKING, "1")  # what fit() reads as it builds its callbacks
    trainer = real_trainer()
    with_plain_framework_versions(trainer)
    states = [cb for cb in trainer._create_default_callbacks()
              if isinstance(cb, StateManagerCallback)]
    assert [type(cb) for cb in states] == [train_page.PlainVersionsStateManager], states
    assert states[0]._datasets == {}  # Ray's callback's state, carried over
    # Ray's callback asks for the versions by its module's name for the function.
    assert "_get_framework_version" in inspect.getsource(StateManagerCallback.after_worker_group_start)

    def imports_torch(answer: dict) -> bool:
        code = "import pickle, sys; pickle.loads(sys.stdin.buffer.read()); print('torch' in sys.modules)"
        return subprocess.run([sys.executable, "-c", code], input=pickle.dumps(answer),
                              capture_output=True, check=True).stdout.decode().strip() == "True"

    rays = train_page._rays_versions(TrainingFramework.TORCH)
    plain = train_page.plain_framework_versions(TrainingFramework.TORCH)
    assert imports_torch(rays)  # why the hook is there: a Ray that fixes this makes it moot
    assert not imports_torch(plain)
    assert plain == rays and {type(v) for v in plain.values()} == {str}, plain


TENSORFLOW_CONFIG = r"""
import inspect, pickle, sys
from orchestrator.driver.backends import backend_named
config = pickle.loads(pickle.dumps(backend_named("tensorflow").ray_config(30.0, use_gpu=False)))
backend = config.backend_cls()
print("tensorflow" in sys.modules)
from ray.train.tensorflow.config import TensorflowConfig, _setup_tensorflow_environment
print(config.framework == TensorflowConfig().framework, config.to_dict() == TensorflowConfig().to_dict(),
      sorted(inspect.signature(_setup_tensorflow_environment).parameters))
"""


def test_the_tensorflow_backend_leaves_tensorflow_out_of_the_driver_and_the_controller():
    """Building the config (the driver) and what Ray Train's controller does with it (unpickle
    it, make its backend) import no tensorflow, in a fresh process; the worker-side function
    is Ray's, with the parameters passed here; the config reads as Ray's TensorflowConfig."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", TENSORFLOW_CONFIG], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[1]).stdout.split("\n")
    assert out[:2] == ["False", "True True ['index', 'worker_addresses']"], out


def test_the_monitor_killed_before_shutdown_is_found_where_ray_keeps_its_processes(monkeypatch):
    """Ray's node keeps its processes as services.ProcessInfo tuples by type; the monitor's
    is killed (here a stand-in node holding a real process), others are left to Ray. A raylet
    that exited is seen there too (a service then stops instead of running the next command on
    a dead Ray)."""
    import subprocess
    import sys

    from ray._private import ray_constants, services, worker
    from ray._private.node import Node

    from orchestrator.ray_internals.cluster import exited_ray_process, stop_autoscaler_monitor

    assert "process" in services.ProcessInfo._fields
    assert "self.all_processes" in inspect.getsource(Node.__init__)
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
                for _ in range(2)]
    def info(process):
        return services.ProcessInfo(process, *[None] * (len(services.ProcessInfo._fields) - 1))

    node = type("Node", (), {"all_processes": {
        ray_constants.PROCESS_TYPE_MONITOR: [info(sleepers[0])],
        ray_constants.PROCESS_TYPE_RAYLET: [info(sleepers[1])]}})()
    monkeypatch.setattr(worker, "_global_node", node)
    try:
        stop_autoscaler_monitor()
        assert sleepers[0].poll() is not None and sleepers[1].poll() is None
        assert exited_ray_process() is None
        sleepers[1].kill()
        sleepers[1].wait()
        assert exited_ray_process() == ray_constants.PROCESS_TYPE_RAYLET
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def test_a_thread_closed_to_rays_process_starts_starts_none_and_others_still_do():
    """A command that abandons the Ray it was starting in a thread closes that thread to
    Ray's process starts before it kills the tree: the thread's next start raises instead of
    leaving a process the kill did not see; every other thread still starts Ray's processes.
    ray.init starts each of its processes through the function this replaces. A thread that
    asks for lower-priority starts gets them; the others' are unchanged."""
    import threading

    from ray._private import node as ray_node
    from ray._private import services

    from orchestrator.ray_internals import process_starts

    assert process_starts.installed()
    assert "start_ray_process(" in inspect.getsource(services.start_gcs_server)
    assert "start_raylet(" in inspect.getsource(ray_node.Node.start_raylet)
    seen = {}

    def start(key: str) -> None:
        try:
            services.start_ray_process(["true"], "test", fate_share=False)
            seen[key] = "started"
        except process_starts.StartsClosed:
            seen[key] = "refused"

    def closed_thread() -> None:
        start("closed")
        # a thread it starts on its behalf (the dashboard's start) is closed with it
        helper = process_starts.thread_for(lambda: start("its helper"), "helper")
        helper.start()
        helper.join()

    thread = threading.Thread(target=closed_thread)
    process_starts.close_starts(thread)
    thread.start()
    thread.join()
    assert seen == {"closed": "refused", "its helper": "refused"}
    started = services.start_ray_process(["true"], "test", fate_share=False)
    assert started.process.wait(timeout=30) == 0

    def lowered() -> None:  # a thread that asked for its starts to run 3 nice levels lower
        process_starts.lower_priority_of_starts(3)
        info = services.start_ray_process(["sleep", "30"], "test", fate_share=False)
        seen["lowered"] = os.getpriority(os.PRIO_PROCESS, info.process.pid) - os.getpriority(
            os.PRIO_PROCESS, 0)
        info.process.kill()
        info.process.wait()

    thread = threading.Thread(target=lowered)
    thread.start()
    thread.join()
    same = services.start_ray_process(["sleep", "30"], "test", fate_share=False)
    seen["this thread's"] = os.getpriority(os.PRIO_PROCESS, same.process.pid) - os.getpriority(
        os.PRIO_PROCESS, 0)
    same.process.kill()
    same.process.wait()
    assert seen["lowered"] == 3 and seen["this thread's"] == 0, seen


ABANDONED_MID_START = r"""
import atexit, sys, threading

@atexit.register  # before Ray's import registers its shutdown: runs after it
def last():
    print("connected at the end:", ray.is_initialized(), file=sys.stderr)

import ray
from ray._private import worker
from orchestrator.cli import exit_now
from orchestrator.config.schema import ClusterConfig
from orchestrator.driver.ray_session import RaySession

connected, killed, connect = threading.Event(), threading.Event(), worker.connect
listen = worker.listen_error_messages

def held_after_connecting(*args, **kwargs):  # ray.init's steps after it: once Ray is killed
    connect(*args, **kwargs)
    connected.set()
    if sys.argv[1] == "connecting":
        killed.wait()

def listening_once_killed(*args):  # Ray's error listener's first call, on the killed GCS
    killed.wait()
    listen(*args)

worker.connect, worker.listen_error_messages = held_after_connecting, listening_once_killed
session = RaySession(ClusterConfig(), {}, False)
session.start_in_background()
assert connected.wait(120)
if sys.argv[1] == "started":
    assert session._started.wait(120) and session._start_error is None
session.abandon()  # what bad input does to the session started beside the checks
killed.set()
worker.global_worker.listener_thread.join(60)  # its traceback, once, came before the exit
exit_now(2)
"""


@pytest.mark.parametrize("moment", ["connecting", "started"])
def test_a_command_that_abandons_its_embedded_ray_exits_at_once_with_its_own_code(moment):
    """cluster.no_ray_shutdown_at_exit: the command killed the cluster it started (its input
    was bad), so Ray's own shutdown at exit, which would wait on the dead GCS, is left out
    (the driver is still connected when the last exit handler runs): killed while ray.init
    was connecting, that wait could last 60 s, then Ray's GCS client ended the command with
    exit code 1 and its own lines in place of the one error line. Ray's error listener, whose
    first call met the killed GCS, ends without its traceback after that line."""
    import subprocess
    import sys

    from scripts.local_cluster import node_env

    done = subprocess.run([sys.executable, "-c", ABANDONED_MID_START, moment],
                          capture_output=True, text=True, env=node_env(), timeout=300,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 2 and "GCS" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == ["connected at the end: True"], done.stderr


def test_the_workers_environment_imports_ahead_with_the_threads_ray_would_give(monkeypatch):
    """orchestrator/worker/warm.py: the hook only where there is something to import and the
    job has no hook of its own; it sets OMP_NUM_THREADS as Ray would for the worker's CPUs
    (torch sizes its pool at import), the node's own value first; a module that cannot be
    imported is said, never raised."""
    import importlib

    from orchestrator.ray_internals.knobs import SETUP_HOOK
    from orchestrator.worker.warm import (
        HOOK,
        WARM_IMPORTS,
        WORKER_CPUS,
        import_modules,
        worker_runtime_env,
    )

    monkeypatch.delenv(SETUP_HOOK, raising=False)
    assert worker_runtime_env({"A": "1"}, (), 1.0) == {"env_vars": {"A": "1"}}
    env = worker_runtime_env({"A": "1"}, ("torch", "json"), 0.5)["env_vars"]
    assert env == {"A": "1", WARM_IMPORTS: "torch,json", WORKER_CPUS: "0.5", SETUP_HOOK: HOOK}
    module, _, function = HOOK.rpartition(".")
    assert getattr(importlib.import_module(module), function) is import_modules
    monkeypatch.setenv(SETUP_HOOK, "users.own.hook")  # a job's own hook stays the one
    assert worker_runtime_env({"A": "1"}, ("torch",), 1.0) == {"env_vars": {"A": "1"}}

    monkeypatch.setenv(WARM_IMPORTS, "json,no_such_module_here")  # said, not raised
    for cpus, node_value, threads in [("0.5", None, "1"), ("2.7", None, "2"), ("1", "3", "3")]:
        monkeypatch.setenv(WORKER_CPUS, cpus)
        if node_value is None:
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("OMP_NUM_THREADS", node_value)
        import_modules()
        assert os.environ["OMP_NUM_THREADS"] == threads


WARM_CHECK = """
import json, sys
import ray
from orchestrator.worker.warm import worker_runtime_env
ray.init(address=sys.argv[1], logging_level="ERROR")

@ray.remote(num_cpus=1, runtime_env=worker_runtime_env({}, ("torch",), 1.0))
class Worker:
    def __init__(self):
        self.ahead = "torch" in sys.modules  # before anything of the actor's imports it

    def seen(self):
        import torch
        return {"ahead": self.ahead, "threads": torch.get_num_threads()}

print(json.dumps(ray.get(Worker.remote().seen.remote())))
"""


def test_a_worker_process_imports_torch_ahead_and_keeps_one_thread_per_cpu(ray_head):
    """The hook runs in Ray's real worker process (the variable Ray reads, knobs.SETUP_HOOK),
    and torch, imported before Ray placed the actor, still has the one thread Ray gives a
    1-CPU worker (two here without OMP_NUM_THREADS: 8x slower DDP on this machine)."""
    import subprocess
    import sys

    from scripts.local_cluster import node_env

    done = subprocess.run([sys.executable, "-c", WARM_CHECK, ray_head.address],
                          capture_output=True, text=True, env=node_env(), timeout=300,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"ahead": True, "threads": 1}


def test_workers_placed_whose_processes_die_at_their_start_are_told_from_no_room(tmp_path):
    """A worker process that dies as it starts never registers, and the raylet holds its CPUs
    while it starts another every 60 s: the placement timeout said 'no room ... CPU 0/2 free'.
    Here a worker's PYTHONPATH holds a re.py (what the command's folder on PYTHONPATH did):
    the group is placed, the worker waits, and the reason quotes the traceback's last line from
    this node's raylet.err, written after the watch began. A group that cannot be placed is
    still 'no room'."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from orchestrator.driver.placement_watch import timeout_reason
    from orchestrator.ray_internals.cluster import (
        last_error_line,
        log_size,
        placed_but_not_started,
        raylet_error_log,
    )

    (tmp_path / "re.py").write_text('raise ImportError("the project\'s re.py")\n')
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        @ray.remote(num_cpus=1)
        class RayTrainWorker:  # Ray Train's worker class's name, which the check looks for
            def ping(self) -> int:
                return 1

        def worker_in(group, env=None):
            return RayTrainWorker.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(group),
                runtime_env={"env_vars": env or {}}).remote()

        too_big = placement_group([{"CPU": 3}])
        waiting = worker_in(too_big)
        assert placed_but_not_started() == []
        assert timeout_reason("{'CPU': 3} * 1 workers", 31, 30).startswith(
            "cluster: no room for {'CPU': 3} * 1 workers after 31 s")
        ray.kill(waiting)
        remove_placement_group(too_big)

        log = raylet_error_log()
        start = log_size(log)
        group = placement_group([{"CPU": 1}])
        ray.get(group.ready(), timeout=60)
        crashing = worker_in(group, {"PYTHONPATH": str(tmp_path)})  # kept: a dropped handle ends it
        deadline = time.time() + 120
        while last_error_line(log, start) is None and time.time() < deadline:
            time.sleep(0.5)
        here = ray.get_runtime_context().get_node_id()
        assert placed_but_not_started() == [here]
        reason = timeout_reason("{'CPU': 1.0} * 1 workers", 31, 30, log, start)
        assert reason.startswith("cluster: {'CPU': 1.0} * 1 workers were placed on "), reason
        assert "ImportError: the project's re.py" in reason and str(log) in reason, reason
        ray.kill(crashing)
    finally:
        ray.shutdown()


def test_an_actors_runtime_environment_is_laid_over_its_creators_as_ray_core_does():
    from orchestrator.ray_internals.group_prestart import inherited

    job = '{"env_vars": {"A": "1", "B": "job"}, "py_executable": "x"}'
    assert inherited(job, {}) == job  # no options of its own: the creator's string as it is
    assert inherited(job, {"env_vars": {"B": "é", "C": "3"}, "py_executable": "y"}) == \
        '{"env_vars":{"A":"1","B":"é","C":"3"},"py_executable":"y"}'
    assert inherited("", {"env_vars": {"A": "1"}}) == '{"env_vars":{"A":"1"}}'


STARTED_AHEAD_CHECK = """
import json, os, sys, time
from pathlib import Path
import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
from orchestrator.ray_internals import group_prestart
from orchestrator.ray_internals.ready_processes import actors_started_since, idle_processes
from orchestrator.ray_internals.train_hooks import (
    with_workers_started_ahead, without_autoscaling_requests, without_unneeded_actors)
from orchestrator.worker.warm import worker_runtime_env

ray.init(address=sys.argv[1], logging_level="ERROR", runtime_env={"env_vars": {"JOB_VAR": "1"}})
out = Path(sys.argv[2])
asked, envs = [], []

def at_once(asks, slots):
    # The hook's call, made before the controller starts and awaited: the group's workers
    # then find their processes idle, whenever the raylet started them. (The controller would
    # take the one asked for the synchronization actor, whose environment is its own: that
    # one is compared with Ray's below.)
    (workers, count), (controller, _) = asks
    envs.extend([workers, controller])
    assert group_prestart.prestart(workers, count, 60) is None
    while len(idle_processes()) < count:
        time.sleep(0.05)
    asked.extend(idle_processes())

group_prestart.prestart_beside_controller = at_once

def train(config):
    import ray.train
    rank = ray.train.get_context().get_world_rank()
    (out / str(rank)).write_text(json.dumps({"pid": os.getpid()}))

trainer = DataParallelTrainer(
    train, scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.1}),
    run_config=RunConfig(storage_path=str(out / "ray_train"),
                         worker_runtime_env=worker_runtime_env({"WORKER_VAR": "2"}, (), 0.1)))
without_unneeded_actors(trainer, keep_cleaner=False)  # as a command's run
without_autoscaling_requests(trainer)
with_workers_started_ahead(trainer, False)
trainer.fit()
actual = {a["class"]: a["runtime_env"] for a in actors_started_since(0)}
ranks = [json.loads((out / str(rank)).read_text()) for rank in range(2)]
print(json.dumps({"asked": sorted(asked), "ranks": ranks,
                  "workers": sorted(rank["pid"] for rank in ranks),
                  "envs": envs, "actual": [actual["RayTrainWorker"], actual["SynchronizationActor"]]}))
"""


def test_a_runs_group_starts_in_processes_asked_for_with_the_environments_the_hook_rebuilds(
        ray_head, tmp_path):
    """The runtime environments the hook rebuilds, as fit() is about to start the controller
    (group_prestart.group_runtime_envs), are the ones Ray gives the group's actors, to the
    byte: both of a real run's workers start in the processes asked for with theirs, and the
    synchronization actor's is Ray's."""
    import subprocess
    import sys

    from scripts.local_cluster import node_env

    done = subprocess.run([sys.executable, "-c", STARTED_AHEAD_CHECK, ray_head.address,
                           str(tmp_path)], capture_output=True, text=True, env=node_env(),
                          timeout=300, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(seen["asked"]) == 2 and seen["workers"] == seen["asked"], seen
    assert seen["envs"] == seen["actual"]  # the synchronization actor's too


DASHBOARD_BESIDE_RAYLET_CHECK = r"""
import json, logging, os, re, sys, threading, time, urllib.error, urllib.request
import ray
from ray._private import node as ray_node, ray_constants, services
from orchestrator.ray_internals import head_start
from orchestrator.ray_internals.knobs import CONNECT_RETRY, EMBEDDED_SYSTEM_CONFIG

class Told(logging.Handler):
    def emit(self, record):
        seen.setdefault("warnings", []).append(record.getMessage())

logging.getLogger("orchestrator").addHandler(Told())
release = threading.Event()
if sys.argv[2] in ("fail", "stop"):  # the dashboard's start fails, as Ray reports it, once released
    def failing(*args, **kwargs):
        release.wait(120)
        raise RuntimeError("Failed to start the dashboard, return code 1\nThe last 20 lines ...")
    services.start_api_server = failing

seen = {}
start_raylet = ray_node.Node.start_raylet

def watched(self, *args, **kwargs):
    published = self.get_gcs_client().internal_kv_get(
        ray_constants.DASHBOARD_ADDRESS.encode(), ray_constants.KV_NAMESPACE_DASHBOARD)
    seen["published_at_raylet_start"] = published and published.decode()
    return start_raylet(self, *args, **kwargs)

ray_node.Node.start_raylet = watched
start_processes = ray_node.Node.start_ray_processes

def registered_on_return(self):
    start_processes(self)
    from ray.core.generated.gcs_pb2 import GcsNodeInfo
    alive = self.get_gcs_client().get_all_node_info(
        timeout=10, state_filter=GcsNodeInfo.GcsNodeState.ALIVE)
    seen["registered_when_processes_started"] = self.node_id in [n.hex() for n in alive]

ray_node.Node.start_ray_processes = registered_on_return
port = int(sys.argv[1])
from orchestrator.driver.ports import PortHold
hold = PortHold(port)  # the command's: the port stays taken until the dashboard starts
deferred = sys.argv[2] in ("start", "stop")  # as a command's: until its workers have started
head_start.DASHBOARD_DEFER_MAX_S = 600  # its bound in time: not what is checked here (a slow machine)
rays_start = head_start._ray_start_api_server

def start_called(*args, **kwargs):
    seen["dashboard_start_called"] = True
    seen["called_before_release"] = not head_start._workers_started.is_set()
    return rays_start(*args, **kwargs)

head_start._ray_start_api_server = start_called
with head_start.embedded_head(log_monitor=False, monitor=False, defer_dashboard=deferred,
                              dashboard_port_hold=hold):
    context = ray.init(address="local", num_cpus=1, include_dashboard=True,
                       dashboard_host="127.0.0.1", dashboard_port=port, log_to_driver=False,
                       _system_config=EMBEDDED_SYSTEM_CONFIG)
# the config every process of the cluster reads from its GCS (the raylet's store retry, knobs.py)
config = ray._private.state.state.get_system_config()
seen["connect_retry"] = {k: config.get(k) for k in CONNECT_RETRY}
node = ray._private.worker._global_node
start = node._orchestrator_dashboard_start
seen["init_returned_while_held"] = not release.is_set() and not start.published.is_set()
seen["task"] = ray.get(ray.remote(lambda: "ran").remote())  # the cluster serves, whatever its dashboard does
if sys.argv[2] in ("fail", "stop"):
    if sys.argv[2] == "stop":
        head_start.stopping()  # what the command's own shutdown says first
    release.set()
    start.published.wait(60)
    seen["dashboard_started"] = seen.get("dashboard_start_called", False)
    ray.shutdown()
    print(json.dumps(seen))
    sys.exit(0)
import socket
probe = socket.socket()  # as Ray's own check of a port, or another command's head would bind
probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    probe.bind(("127.0.0.1", port))
    seen["port_free_while_held"] = True
except OSError:
    seen["port_free_while_held"] = False
probe.close()
head_start.dashboard_may_start()  # the command's workers started
start.published.wait(120)
info = ray.nodes()[0]  # the agent's HTTP server on a port of the kernel's, not 52365
agent = f"http://{info['NodeManagerAddress']}:{info['DashboardAgentListenPort']}"
deadline = time.monotonic() + 60
while "agent_http" not in seen and time.monotonic() < deadline:
    try:
        seen["agent_http"] = urllib.request.urlopen(f"{agent}/api/local_raylet_healthz", timeout=10).status
    except OSError:
        time.sleep(0.2)
dashboard = node.all_processes[ray_constants.PROCESS_TYPE_DASHBOARD][0].process
raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process
seen["started"] = sorted(node.all_processes)
seen["dashboard_wait_s"] = ray_constants.RAY_DASHBOARD_STARTUP_TIMEOUT_S  # Ray's 60: too short loaded
seen["url"] = context.dashboard_url
# what the raylet hands the workers it starts (inside its worker command)
seen["raylet_webui"] = re.findall(r"--webui=(\S+)", open(f"/proc/{raylet.pid}/cmdline").read())
# its agents (its children before any worker) at the dashboard's priority
agents = [int(c) for t in os.listdir(f"/proc/{raylet.pid}/task")
          for c in open(f"/proc/{raylet.pid}/task/{t}/children").read().split()
          if open(f"/proc/{c}/cmdline").read().startswith(("ray::DashboardAgent", "ray::RuntimeEnvAgent"))]
seen["agents"] = len(agents)
seen["agents_niceness_over_ours"] = sorted({os.getpriority(os.PRIO_PROCESS, a) - os.getpriority(os.PRIO_PROCESS, 0)
                                            for a in agents})
# the dashboard agent runs in full (packages found), which the driver learnt without importing
seen["agent_minimal"] = "--minimal" in open(f"/proc/{raylet.pid}/cmdline").read()
seen["dashboard_packages_imported"] = sorted(
    m for m in ("aiohttp", "aiohttp_cors", "opencensus", "prometheus_client") if m in sys.modules)
deadline = time.monotonic() + 60
while "http" not in seen and time.monotonic() < deadline:
    try:
        seen["http"] = urllib.request.urlopen(f"http://{context.dashboard_url}/api/version",
                                              timeout=10).status
    except urllib.error.HTTPError as exc:  # 401 without the token: it answers
        seen["http"] = exc.code
    except OSError:
        time.sleep(0.1)
ours = os.getpriority(os.PRIO_PROCESS, 0)
modules, parents = [], [dashboard.pid]
while parents:  # every process under the dashboard (its modules start through a fork server)
    pid = parents.pop()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            children = [int(c) for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        modules += children
        parents += children
seen["niceness_over_ours"] = sorted({os.getpriority(os.PRIO_PROCESS, int(p)) - ours
                                     for p in [dashboard.pid, *modules]})
seen["modules"] = len(modules)
ray.shutdown()
seen["dashboard_ended_with_ray"] = dashboard.poll() is not None
print(json.dumps(seen))
"""


def dashboard_check(outcome: str) -> dict:
    import subprocess
    import sys

    from orchestrator.ray_internals.knobs import connect_retry_env
    from scripts.local_cluster import free_port, node_env

    port = free_port()
    env = {k: v for k, v in node_env().items() if k not in connect_retry_env()}  # the command's
    with contextlib.ExitStack() as stack:  # Ray's default agent port taken (another Ray's)
        agents_default = stack.enter_context(socket.socket())
        with contextlib.suppress(OSError):
            agents_default.bind(("0.0.0.0", 52365))
            agents_default.listen()
        done = subprocess.run([sys.executable, "-c", DASHBOARD_BESIDE_RAYLET_CHECK, str(port),
                               outcome], capture_output=True, text=True, env=env, timeout=300,
                              cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"port": port}


def test_the_dashboards_packages_are_found_as_rays_import_would_find_them(monkeypatch):
    """dashboard_packages.py: Ray's node asks whether the dashboard's packages are installed
    through this module's answer, which looks up the modules Ray's own check imports: none
    missing here (as Ray's import says), and one not installed is named."""
    import subprocess
    import sys

    from ray._private import utils as ray_utils

    from orchestrator.ray_internals import dashboard_packages

    assert dashboard_packages.installed()
    listed = dashboard_packages.listed_modules()
    assert {"aiohttp", "aiohttp.web", "grpc", "prometheus_client", "pydantic"} <= set(listed)
    rays = subprocess.run([sys.executable, "-c", "import ray.dashboard.optional_deps"],
                          capture_output=True, text=True, timeout=120)
    assert rays.returncode == 0, rays.stderr[-2000:]
    assert ray_utils.get_dashboard_dependency_error() is None
    assert not dashboard_packages.findable("aiohttp.no_such_module")
    assert dashboard_packages.findable("opentelemetry.exporter.prometheus")
    monkeypatch.setattr(dashboard_packages, "listed_modules",
                        lambda: (*listed, "aiohttp.no_such_module", "no_such_package"))
    error = ray_utils.get_dashboard_dependency_error()
    assert isinstance(error, ImportError) and error.name == "aiohttp.no_such_module"


def test_an_embedded_heads_raylet_starts_before_its_dashboard_has_published_its_address():
    """head_start.py: the raylet starts while the dashboard is still starting, with the
    address the dashboard then publishes (the one ray.init returns, handed to its workers);
    the dashboard, and each of its module processes, runs 15 nice levels below the command,
    not the raylet's two agents;
    it outlives the thread that started it, answers there, and ends with Ray. No log monitor
    or autoscaler monitor was asked for, and neither started. The raylet's start waits for
    no retry of its store, and its registration is known as soon as it comes (not at Ray's
    next once-a-second ask). A command's dashboard starts once its workers have (or when
    the command ends first, never). A dashboard whose start fails
    is one warning line, and the cluster runs tasks all the same (ray.init does not wait for
    the dashboard, nor fail with it); a command's own shutdown is not such a failure."""
    from orchestrator.ray_internals import head_start

    failed = dashboard_check("fail")  # its start held until the cluster ran a task
    assert failed["init_returned_while_held"] and failed["task"] == "ran", failed
    assert failed["warnings"] == ["the Ray dashboard did not start (RuntimeError: Failed to "
                                  "start the dashboard, return code 1); the run goes on "
                                  "without it"], failed
    stopped = dashboard_check("stop")
    assert stopped["init_returned_while_held"] and "warnings" not in stopped, stopped
    assert not stopped["dashboard_started"], stopped  # deferred, then the command ended
    seen = dashboard_check("start")
    port = seen["port"]
    assert seen["task"] == "ran" and "warnings" not in seen, seen
    assert seen["called_before_release"] is False, seen  # deferred until the workers started
    # its port held meanwhile (driver/ports.py); the agent serves beside another Ray's 52365
    assert seen["port_free_while_held"] is False and seen["agent_http"] == 200, seen
    assert seen["dashboard_wait_s"] == head_start.DASHBOARD_START_WAIT_S, seen
    assert seen["niceness_over_ours"] == [15] and seen["modules"] >= 5, seen
    # the agents at Ray's priority: the raylet crashes when one misses its 15 s (head_start.py)
    assert seen["agents"] == 2 and seen["agents_niceness_over_ours"] == [0], seen
    assert seen["published_at_raylet_start"] is None, seen
    assert seen["url"] == f"127.0.0.1:{port}" and seen["raylet_webui"] == [f"127.0.0.1:{port}"]
    assert seen["http"] in (200, 401) and seen["dashboard_ended_with_ray"], seen
    assert "raylet" in seen["started"], seen
    assert seen["agent_minimal"] is False and seen["dashboard_packages_imported"] == [], seen
    assert "log_monitor" not in seen["started"] and "monitor" not in seen["started"], seen
    # Ray's own waits at a head's start: the raylet's 1 s retry of its store, and ray.init's
    # once-a-second ask for the node's registration
    assert seen["connect_retry"] == {"raylet_client_connect_timeout_milliseconds": 50,
                                     "raylet_client_num_connect_attempts": 200}, seen
    assert seen["registered_when_processes_started"] is True, seen


BARRIER_IN_CONTROLLER_CHECK = r"""
import json, sys, time
import ray
from ray.train.v2.api import data_parallel_trainer
from orchestrator.ray_internals import controller_barrier

from orchestrator.ray_internals.train_hooks import RAYS_ASYNC_CALLS, barrier_room

WIDE = RAYS_ASYNC_CALLS + 100  # more ranks than Ray's default lets an async actor take at once
ray.init(address=sys.argv[1], logging_level="ERROR")
seen = {"swapped": controller_barrier.with_barrier_in_controller(),
        "controller_class": data_parallel_trainer.TrainController.__module__,
        "barrier_class": controller_barrier._Barrier.__name__,
        "rays_default": ray.actor.DEFAULT_MAX_CONCURRENCY_ASYNC,
        "own_barrier_room": barrier_room(WIDE, barrier_in_controller=False),
        "room": barrier_room(WIDE, barrier_in_controller=True)}  # before fit() starts it

@ray.remote(num_cpus=0)
class Controller:  # the calls Ray Train's controller makes, from its event loop
    barrier_call = controller_barrier.TrainController.barrier_call

    async def start_group(self):
        from ray.train.v2._internal.execution.worker_group import worker_group
        controller_barrier._in_this_class = True
        return worker_group.SynchronizationActor.options(label_selector={}).remote(
            timeout_s=60, warn_interval_s=60)

    async def relax(self, barrier):  # a preemption's: a ray.get on the loop the call needs
        if hasattr(controller_barrier._Barrier, "set_required_ranks"):  # Ray 2.60's
            return ray.get(barrier.set_required_ranks.remote([0, 1]))
        return ray.get(barrier.get_counter.remote()) == 0  # what Ray 2.58 offers

    async def shut_down(self, barrier):
        from ray.train.v2._internal.execution.worker_group import state
        state._shutdown_sync_actor(barrier)

@ray.remote(num_cpus=0)
def rank(barrier, r, world):
    try:
        return ray.get(barrier.broadcast_from_rank_zero.remote(
            world_rank=r, world_size=world, data=f"from {r}", caller_method_name="check"))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

controller = Controller.remote()
barrier = ray.get(controller.start_group.remote())
seen["handle"] = type(barrier).__name__
seen["agreed"] = ray.get([rank.remote(barrier, r, 2) for r in range(2)])
# A preemption agreement of WIDE ranks: every call held at the barrier until the last arrives.
seen["wide"] = sorted(set(ray.get([barrier.broadcast_from_rank_zero.remote(
    world_rank=r, world_size=WIDE, data=f"from {r}", caller_method_name="wide")
    for r in range(WIDE)], timeout=240)))
seen["relaxed"] = ray.get(controller.relax.remote(barrier), timeout=60)
alone = rank.remote(barrier, 1, 2)  # waits for rank 0, which never comes
while ray.get(barrier.get_counter.remote()) != 1:  # until it is inside the barrier
    time.sleep(0.05)
ray.get(controller.shut_down.remote(barrier))
seen["waiter_at_shutdown"] = ray.get(alone, timeout=60)
seen["after_shutdown"] = ray.get(rank.remote(barrier, 0, 1), timeout=60)
print(json.dumps(seen))
"""


def test_a_worker_groups_barrier_lives_in_its_controller_and_ends_with_the_group(ray_head):
    """controller_barrier.py, against the installed Ray Train: fit()'s controller class is the
    subclass, the worker group's SynchronizationActor.options().remote() makes a barrier in the
    controller (Ray's own class), the ranks agree through it with rank 0's value, the
    controller's own call from its event loop answers (no wait on that loop), and the group's
    shutdown releases a rank waiting inside, as killing Ray's actor would, and refuses later
    calls; with room for more ranks than Ray's default lets an async actor take at once (a
    1,100-rank agreement answers every rank). (A real run's groups: the actor counts in test_service.py and test_preemption.py.)"""
    import subprocess
    import sys

    from scripts.local_cluster import node_env

    done = subprocess.run([sys.executable, "-c", BARRIER_IN_CONTROLLER_CHECK, ray_head.address],
                          capture_output=True, text=True, env=node_env(), timeout=300,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["swapped"] and seen["controller_class"].endswith("controller_barrier"), seen
    assert seen["barrier_class"] == "SynchronizationActor" and seen["handle"] == "HostedBarrier"
    assert seen["agreed"] == ["from 0", "from 0"] and seen["relaxed"] is True, seen
    # More ranks than Ray lets an async actor (the controller) take at once, all answered:
    # the controller started with room for them (Ray's own barrier actor would not be: said).
    assert seen["rays_default"] == 1000 and seen["room"] == [] and seen["wide"] == ["from 0"]
    assert "may hang at its first collective" in seen["own_barrier_room"][0], seen
    assert "SynchronizationBarrierResetError" in seen["waiter_at_shutdown"], seen
    assert "was reset" in seen["waiter_at_shutdown"], seen  # released by the shutdown
    assert "was shut down" in seen["after_shutdown"], seen


FORK_SERVER_CHECK = r"""
import atexit, json, os, sys, time
import ray
from orchestrator.driver.backends import backend_named
from orchestrator.ray_internals import fork_server

seen, out = {}, sys.argv[2]

@ray.remote(num_cpus=0.1)
class Probe:
    def __init__(self):
        # before anything of the actor's imports them
        self.ahead = all(m in sys.modules for m in ("torch", "ray.train.torch", "ray.data"))
    def facts(self):
        import numpy, torch
        return {"pid": os.getpid(), "parent": os.getppid(), "ahead": self.ahead,
                "threads": torch.get_num_threads(), "id": ray.ObjectRef.from_random().hex(),
                "numpy": int(numpy.random.randint(1 << 30))}
    def leave(self, mark):  # an actor's own exit: its process's exit handlers run
        atexit.register(lambda: open(mark, "w").write("ran"))
        ray.actor.exit_actor()

def wait_for(check, timeout=60):
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return check()

with fork_server.socket_dir(True) as sock:
    seen["private"] = oct(os.stat(os.path.dirname(sock)).st_mode & 0o777)
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False,
             runtime_env={"py_executable": fork_server.client_executable(sock)})
    one_cpu = {"env_vars": {"ORCHESTRATOR_WORKER_CPUS": "1"}}
    before = Probe.options(runtime_env=one_cpu).remote()  # no server yet: Ray's own start
    seen["before"] = ray.get(before.facts.remote(), timeout=120)
    with fork_server.serving(sock, backend_named("torch").fork_imports) as server:
        wait_for(lambda: os.path.exists(sock), 120)
        forked, sibling = (Probe.options(runtime_env=one_cpu).remote() for _ in range(2))
        seen["forked"], seen["sibling"] = ray.get([forked.facts.remote(),
                                                   sibling.facts.remote()], timeout=120)
        seen["server"] = server.pid
        # A worker another node's raylet started (its RAY_RAYLET_PID another's) is turned
        # away: no pid comes back, and its client starts it as Ray would.
        import array, socket
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(sock)
        other = {"argv": ["worker.py"], "env": {**os.environ, "RAY_RAYLET_PID": "1"}, "cwd": "/"}
        conn.sendmsg([json.dumps(other).encode() + b"\n"],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        seen["other_node_turned_away"] = conn.makefile("r").readline() == ""
        conn.close()
        ray.kill(forked)
        seen["killed_child_gone"] = wait_for(
            lambda: not os.path.exists(f"/proc/{seen['forked']['pid']}"))
        sibling.leave.remote(os.path.join(out, "atexit"))
        seen["exit_handlers_ran"] = wait_for(lambda: os.path.exists(os.path.join(out, "atexit")))
    seen["server_ended"] = server.poll() is not None and not os.path.exists(sock)
    # A preload that seeds Ray's ID generator (a random ID drawn): the server refuses to serve.
    with fork_server.serving(sock, ("ray:ObjectRef.from_random",)) as refusing:
        seen["refused"] = refusing.wait(timeout=120) == 0 and not os.path.exists(sock)
seen["folder_removed"] = not os.path.exists(os.path.dirname(sock))
print(json.dumps(seen))
"""


def test_a_sweeps_processes_fork_from_its_server_with_torch_imported_and_their_own_threads(
        ray_head, tmp_path):
    """A job whose py_executable is the fork server's client (a sweep's): a process started
    before the server is up is Ray's own; one started after is the server's child, torch, Ray
    Train's torch side and Ray Data imported before the actor's code ran, its thread pool
    sized by its own CPUs (the server's import saw 2), its Ray IDs (Ray Data's import did not
    seed their generator) and numpy stream its own, and a killed actor's forked process goes
    with it, one that exits runs its exit handlers; the server (the torch backend's
    imports) ends with its block and leaves no socket, in a folder only its user can enter and
    that goes with it, and one whose preload drew from Ray's ID generator does not serve."""
    import subprocess
    import sys

    from scripts.local_cluster import node_env

    done = subprocess.run([sys.executable, "-c", FORK_SERVER_CHECK, ray_head.address,
                           str(tmp_path)], capture_output=True, text=True, env=node_env(),
                          timeout=300, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["before"]["parent"] != seen["server"] and not seen["before"]["ahead"], seen
    assert seen["forked"]["parent"] == seen["server"] and seen["forked"]["ahead"], seen
    assert seen["forked"]["threads"] == 1 and seen["killed_child_gone"], seen
    assert seen["sibling"]["parent"] == seen["server"], seen
    # Siblings do not share Ray's IDs or numpy's stream (both seeded in the server otherwise).
    assert seen["forked"]["id"] != seen["sibling"]["id"], seen
    assert seen["forked"]["numpy"] != seen["sibling"]["numpy"], seen
    assert seen["server_ended"] and seen["refused"] and seen["other_node_turned_away"], seen
    assert seen["exit_handlers_ran"], seen  # Ray's worker shuts down in one
    assert seen["private"] == "0o700" and seen["folder_removed"], seen


def test_the_entrypoint_ray_records_for_the_job_is_redacted(monkeypatch):
    """ray.init records the driver's command line through ray._private.utils.
    get_entrypoint_name (the dashboard shows it on its Jobs page and with every Train run): the
    hook wraps what worker.py calls, and a secret on the command line is recorded as ***."""
    import inspect

    import ray._private.utils as utils
    import ray._private.worker as worker

    from orchestrator.ray_internals.entrypoint import redacted_entrypoint

    assert "ray._private.utils.get_entrypoint_name()" in inspect.getsource(worker)
    line = "python -m orchestrator +trainer.api_token=sk-cli-secret-99 run.name=x"
    monkeypatch.setattr(utils, "get_entrypoint_name", lambda: line)
    redacted_entrypoint()
    recorded = utils.get_entrypoint_name()
    assert "sk-cli-secret-99" not in recorded and "+trainer.api_token=***" in recorded
    assert "run.name=x" in recorded
    redacted_entrypoint()  # once only: not wrapped twice
    assert utils.get_entrypoint_name() == recorded


RUN_FORKS_CHECK = r"""
import json, os, sys, time
import ray
from orchestrator.config.schema import ClusterConfig
from orchestrator.driver.backends import backend_named
from orchestrator.driver.ray_session import RaySession
from orchestrator.worker.warm import worker_runtime_env

@ray.remote(num_cpus=0.1)
class Probe:
    def facts(self):
        return {"parent": os.getppid(), "torch_ahead": "torch" in sys.modules}

seen = {}
forks = backend_named("torch").fork_imports
with RaySession(ClusterConfig(address=sys.argv[1]), worker_forks=forks) as session:
    client = session.worker_py_executable
    sock = client.rpartition(" ")[2]
    deadline = time.monotonic() + 120
    while not os.path.exists(sock) and time.monotonic() < deadline:
        time.sleep(0.1)
    seen["server"] = session._fork_server.pid
    env = worker_runtime_env({}, (), 0.1, client)  # what ray_trainer_for gives the workers
    seen["worker"] = ray.get(Probe.options(runtime_env=env).remote().facts.remote(), timeout=120)
    seen["folder"] = os.path.dirname(sock)
seen["folder_removed"] = not os.path.exists(seen["folder"])
seen["server_ended"] = not os.path.exists(f"/proc/{seen['server']}")
print(json.dumps(seen))
"""


def test_a_runs_workers_on_a_joined_cluster_of_this_machine_fork_from_its_server(ray_head):
    """The session of a run on a joined cluster whose nodes are all on this machine starts the
    workers' fork server once Ray is up; a worker given the run's workers' environment
    (ray_trainer_for's) is the server's child, torch imported before its code ran; the server
    and its folder go with the session."""
    import subprocess
    import sys

    from scripts.local_cluster import node_env

    done = subprocess.run([sys.executable, "-c", RUN_FORKS_CHECK, ray_head.address],
                          capture_output=True, text=True, env=node_env(), timeout=300,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["worker"]["parent"] == seen["server"] and seen["worker"]["torch_ahead"], seen
    assert seen["folder_removed"] and seen["server_ended"], seen


BUSY_START_CHECK = r"""
import json, os
import ray
from orchestrator.config.schema import ClusterConfig
from orchestrator.driver.processes import descendants
from orchestrator.driver.ray_session import RaySession
from orchestrator.errors import MachineError

seen = {}
try:
    with RaySession(ClusterConfig(num_cpus=1, dashboard=False)):
        seen["task"] = ray.get(ray.remote(lambda: "ran").remote(), timeout=300)
except MachineError as exc:  # the machine too busy even for that wait: said so
    seen["error"], seen["exit_code"] = str(exc), exc.exit_code
seen["initialized"] = ray.is_initialized()
seen["left"] = [pid for pid, _ in descendants(os.getpid())]
print(json.dumps(seen))
"""


def test_an_embedded_ray_starts_beside_busy_loops_or_says_the_machine_was_too_busy():
    """A loaded machine delays Ray's start, it does not fail it (a raylet still starting is
    waited for: head_start.REGISTER_WAIT_S; its agents at Ray's priority); giving up is exit 1
    with what to do. Either way nothing of that Ray is left running. (In a process of its own:
    a session's end stops every process below the one that opened it.)"""
    import subprocess
    import sys

    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(os.cpu_count() or 2)]
    try:
        done = subprocess.run([sys.executable, "-c", BUSY_START_CHECK], capture_output=True,
                              text=True, timeout=600, cwd=Path(__file__).parent.parent)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    if "error" in seen:
        assert seen["exit_code"] == 1 and "the machine may be too busy" in seen["error"], seen
    else:
        assert seen["task"] == "ran", seen
    assert not seen["initialized"] and seen["left"] == [], seen


def test_a_dashboard_that_did_not_start_is_said_with_its_logs_last_line_and_where_it_is():
    """Ray's error quotes the dashboard's log after a line that only announces it: the warning
    said '(Exception: The last 20 lines of ...dashboard.log (it contains the error message
    from the dashboard):)' and nothing after."""
    from orchestrator.ray_internals.head_start import dashboard_failure

    quoted = Exception("\nThe last 20 lines of /tmp/ray/s/logs/dashboard.log (it contains the "
                       "error message from the dashboard): \n2026 INFO head.py -- starting\n"
                       "OSError: [Errno 98] Address already in use\n")
    assert dashboard_failure(quoted) == ("OSError: [Errno 98] Address already in use; its log: "
                                         "/tmp/ray/s/logs/dashboard.log")
    plain = RuntimeError("Failed to start the dashboard, return code 1\nmore")
    assert dashboard_failure(plain) == "RuntimeError: Failed to start the dashboard, return code 1"


def test_an_elastic_model_parallel_run_is_sized_in_whole_model_copies():
    """elastic_in_multiples: Ray Train's elastic policy, handed to the controller by fit(), is
    swapped for one that rounds the workers the cluster has room for down to a multiple of a
    model copy's (trainer.pipeline.degree x trainer.tensor.degree): 7 CPUs of room make 4
    workers of a P=2 x T=2 job, not 7, and 3 make none (below min_workers: Ray waits)."""
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import create_scaling_policy
    from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy

    from orchestrator.ray_internals.train_hooks import elastic_in_multiples

    trainer, given = real_trainer(), {}
    trainer._initialize_and_run_controller = lambda **kwargs: given.update(kwargs)
    elastic_in_multiples(trainer, 4)
    policy = create_scaling_policy(ScalingConfig(num_workers=(4, 8), resources_per_worker={"CPU": 1}))
    assert type(policy) is ElasticScalingPolicy
    trainer._initialize_and_run_controller(scaling_policy=policy)
    swapped = given["scaling_policy"]
    assert isinstance(swapped, ElasticScalingPolicy) and swapped is not policy

    def room(nodes: dict) -> dict | list:  # what Ray's policy is given: 2.58 a list per node
        return nodes if ray_version() >= (2, 60) else list(nodes.values())

    assert policy._count_possible_workers(room({"a": {"CPU": 5.0}, "b": {"CPU": 2.0}})) == 7
    assert swapped._count_possible_workers(room({"a": {"CPU": 5.0}, "b": {"CPU": 2.0}})) == 4
    assert swapped._count_possible_workers(room({"a": {"CPU": 16.0}})) == 8
    assert swapped._count_possible_workers(room({"a": {"CPU": 3.0}})) == 0


def test_the_tested_ranges_are_pyprojects_and_a_version_outside_turns_the_speed_hooks_off(
        monkeypatch):
    """One line at the start of a command on a Ray or torch outside the range (none inside
    it, none for a torch not installed), and the speed hooks off there or when asked."""
    import re
    import tomllib

    from orchestrator.ray_internals import versions

    deps = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    specs = {re.split(r"[\[>=<]", d)[0]: d for d in deps["project"]["dependencies"]}
    assert specs["ray"] == "ray[train,default]>=2.58,<2.61" and versions.RAY_RANGE == ((2, 58), (2, 61))
    assert specs["torch"] == "torch>=2.12,<2.16" and versions.TORCH_RANGE == ((2, 12), (2, 16))
    assert versions.outside_range("Ray", "2.60.0", versions.RAY_RANGE) is None
    assert versions.outside_range("torch", "2.13.0+cpu", versions.TORCH_RANGE) is None
    assert versions.outside_range("torch", None, versions.TORCH_RANGE) is None
    line = versions.outside_range("Ray", "2.61.0", versions.RAY_RANGE)
    assert line.startswith("Ray 2.61.0 is outside the tested range 2.58-2.60: running without")
    assert versions.outside_range("torch", "2.11.0", versions.TORCH_RANGE).startswith(
        "torch 2.11.0 is outside the tested range 2.12-2.15")
    assert versions.release("2.16.0.dev20261101") == (2, 16)
    assert versions.untested() == () and versions.speed_hooks()  # this environment's
    monkeypatch.setenv(versions.SPEED_HOOKS, "0")
    assert not versions.speed_hooks() and not versions.speed_hooks("barrier")
    monkeypatch.delenv(versions.SPEED_HOOKS)
    # One by name: the others stay on (what fixed_cost's no_<name> variants time).
    monkeypatch.setenv(versions.SPEED_HOOKS_OFF, "barrier, fork_server")
    assert versions.speed_hooks() and versions.speed_hooks("callbacks")
    assert not versions.speed_hooks("barrier") and not versions.speed_hooks("fork_server")
    with pytest.raises(AssertionError):
        versions.speed_hooks("no_such_hook")
    monkeypatch.delenv(versions.SPEED_HOOKS_OFF)
    monkeypatch.setattr(versions, "untested", lambda: (line,))
    assert not versions.speed_hooks() and not versions.speed_hooks("spares")


def test_a_joining_driver_turns_token_auth_on_when_a_token_exists(tmp_path):
    """As the `ray start` head did, on every Ray of the range (2.58 has no helper for it: the
    mode and Ray's config are set by hand there); nothing without a token."""
    import subprocess
    import sys

    code = ("from orchestrator.ray_internals.cluster import use_token_auth_if_available, "
            "token_auth_enabled\nuse_token_auth_if_available()\nprint(token_auth_enabled())")
    token = tmp_path / "with" / ".ray" / "auth_token"
    token.parent.mkdir(parents=True)
    token.write_text("a" * 32)
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    seen = {home: subprocess.run([sys.executable, "-c", code], env={**env, "HOME": str(home)},
                                 capture_output=True, text=True, cwd=Path(__file__).parents[1],
                                 timeout=120).stdout.strip().splitlines()[-1:]
            for home in (tmp_path / "with", tmp_path / "without")}
    assert seen == {tmp_path / "with": ["True"], tmp_path / "without": ["False"]}, seen


WORKER_WITH_DYNAMO = """
import json, os, sys
sys.path.insert(0, {tests!r}); sys.path.insert(0, {project!r})
from orchestrator.driver.backends import backend_named
from orchestrator.worker.training_function import Training
from orchestrator.worker.warm import WARM_IMPORTS, import_modules
from trainers.pytorch.train import main
training = Training("trainers.pytorch.train:main", main, main.__training_info__, backend_named("torch"), {{}})
os.environ[WARM_IMPORTS] = ",".join(training.warm_imports)  # what the driver hands the workers
import_modules()  # as Ray's setup hook does in a CPU worker's process
warm = type(sys.modules.get("torch._dynamo")).__name__
import torch
import trainers.pytorch.loop as loop
from test_pytorch_loop import OneRank, items, trainer
loop.ray.train.torch.get_device = lambda: torch.device("cpu")
ctx = OneRank()
main(ctx, {{"trainer": trainer(max_steps=3), "data": items()}})  # the trainer itself, one rank
print(json.dumps({{"warm": warm, "after_loop": type(sys.modules["torch._dynamo"]).__name__,
                  "steps": len(ctx.reports)}}))
"""


def test_a_pytorch_worker_runs_torchs_own_dynamo():
    """Where user code trains, torch._dynamo is torch's own, imported by the worker's setup
    hook (torch imports it with the first optimizer: ahead, in a process kept ready for a
    restart)."""
    import json
    import subprocess
    import sys

    tests = Path(__file__).parent
    code = WORKER_WITH_DYNAMO.format(tests=str(tests), project=str(tests / "user_project"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tests.parent, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["warm"] == "module" and result["after_loop"] == "module", result
    assert result["steps"] == 3


PAGE_SECRET = "envsecret-Value-0123456789"


def test_the_dashboards_train_page_shows_no_secret_of_the_spec(monkeypatch):
    """Ray Train turns the train loop config (the WorkerSpec) into the run state the
    dashboard's Train page shows, stringifying what is not JSON: run through Ray's own
    conversion, no secret of the config, the storage or the environment is left."""
    import json

    from ray.train.v2._internal.state.schema import RunSettings

    from orchestrator.config.schema import CheckpointConfig, DataConfig
    from orchestrator.storage.location import Credentials, StorageSpec
    from orchestrator.worker.start import WorkerSpec

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", PAGE_SECRET)
    storage = StorageSpec("s3://bucket/run", "http://minio:pa55word@host:9000", "us-east-1",
                          Credentials("AKIAEXAMPLE01", PAGE_SECRET))
    config = {"data": {"path": "s3://AKIAEXAMPLE01:s3cr3tpath@bucket/data"},
              "trainer": {"api_key": "apikey-0123456", "lr": 0.1, "note": PAGE_SECRET}}
    spec = WorkerSpec("mypkg.train:fn", config, DataConfig(), CheckpointConfig(), storage,
                      None, seed=7, recorder=object())
    shown = json.dumps(RunSettings._sanitize_train_loop_config({"spec": spec}))
    assert "mypkg.train:fn" in shown and "'lr': 0.1" in shown, shown
    for secret in ("pa55word", "s3cr3tpath", "apikey-0123456", PAGE_SECRET):
        assert secret not in shown, secret


NODE_AGREEMENT_CHECK = r"""
import json, logging, os, sys, threading
from pathlib import Path
import ray
from orchestrator.ray_internals import preemption_agreement
from orchestrator.ray_internals.barrier_handle import HostedBarrier
from orchestrator.ray_internals.controller_barrier import TrainController, _this_host
from orchestrator.ray_internals.preemption_agreement import NodeAgreement

ray.init(address=sys.argv[1], logging_level="ERROR")
out = Path(sys.argv[2])
warned = []
logging.getLogger("orchestrator").addHandler(
    type("Told", (logging.Handler,), {"emit": lambda self, r: warned.append(r.getMessage())})())

@ray.remote(num_cpus=0)
class Controller:  # the run's controller's own methods, each call counted
    def __init__(self):
        self.calls = {}

    async def new_barrier(self):
        return _this_host().new({"timeout_s": 60}).key

    async def agreement_publish(self, key, check, answer):
        self.calls[f"{key}:{check}"] = self.calls.get(f"{key}:{check}", 0) + 1
        return await TrainController.agreement_publish(self, key, check, answer)

    async def agreement_answer(self, key, check, waited_s=0.0):
        self.calls[f"{key}:{check}"] = self.calls.get(f"{key}:{check}", 0) + 1
        return await TrainController.agreement_answer(self, key, check, waited_s)

    def counted(self):
        return self.calls

    async def shut_down(self, key):
        _this_host().drop(key)

controller = Controller.remote()

def disk(name):
    (out / name).mkdir(mode=0o700, exist_ok=True)
    return out / name

def group(nodes, per_node, disks):
    # Simulated ranks, as Ray Train numbers them: a node's ranks consecutive, rank 0 first.
    barrier = HostedBarrier(controller, ray.get(controller.new_barrier.remote()))
    notice = [None]
    ranks = [NodeAgreement(r, r % per_node, f"10.0.0.{r // per_node}", barrier, lambda: notice[0],
                           disks(r)) for r in range(nodes * per_node)]
    return barrier, notice, ranks

def agree_all(ranks, check):
    got = {}
    threads = [threading.Thread(target=lambda a=a: got.__setitem__(a.rank, a.agree(
        ("from", a.rank, check)))) for a in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return [got.get(a.rank) for a in ranks]

def scenario(nodes, per_node, disks):
    barrier, notice, ranks = group(nodes, per_node, disks)
    agreed = [agree_all(ranks, 1)]
    notice[0] = "notice marked on 0"  # as the watcher marks rank 0
    agreed.append(agree_all(ranks, 2))
    for check in (3, 4, 5):  # rank 0 learns what the others waited as it publishes
        agree_all(ranks, check)
    calls = ray.get(controller.counted.remote())
    for a in ranks:
        a.close()
    return {"agreed": agreed, "calls": [calls.get(f"{barrier.key}:{c}", 0) for c in (1, 2, 3)],
            "waited": ranks[0].waited_s, "left": sorted(p.name for p in out.glob("*/answers-*"))}

seen = {"installed": preemption_agreement.installed(),
        "three_nodes": scenario(3, 2, lambda r: disk(f"node{r // 2}")),
        "one_node": scenario(1, 4, lambda r: disk("node0")),
        # a rank whose node's poster writes to another disk (one address, two /tmp)
        "no_shared_disk": scenario(2, 2, lambda r: disk("other" if r == 3 else f"node{r // 2}"))}
seen["warned"] = warned
# A rank whose node's first rank (here rank 0) ended, its folder removed, before this rank's
# check: it asks the controller, which holds rank 0's answer.
barrier, _, ranks = group(1, 2, lambda r: disk("ended"))
seen["first_ended"] = [ranks[0].agree(("from", 0, 1)), ranks[1].agree(None),
                       ranks[0].agree(("from", 0, 2)), ranks[0].close(), ranks[1].agree(None)]
# A group shut down while a node's poster waits for rank 0's answer: the poster's call fails,
# as a rank waiting in Ray's barrier does.
barrier, _, ranks = group(2, 1, lambda r: disk(f"late{r}"))
waiting = ranks[1].barrier.controller.agreement_answer.remote(barrier.key, 1)
ray.get(controller.shut_down.remote(barrier.key))
try:
    ray.get(waiting, timeout=60)
except Exception as exc:
    seen["at_shutdown"] = type(exc).__name__ + ": " + str(exc).strip().splitlines()[-1]
print(json.dumps(seen))
"""


def test_ranks_agree_with_one_call_per_node_into_the_controller(
        ray_head, tmp_path):
    """preemption_agreement.py against the real controller class on a real Ray, each call into
    it counted: 6 simulated ranks on 3 nodes (each node its own disk) agree on rank 0's notice
    and proposal with 3 calls a check (rank 0's answer, one from each other node's poster: not
    one per rank, which made a check ~3.5 s at 1,024 ranks); 4 ranks on one node with rank 0's
    call alone; a rank that shares no disk with its node's poster asks itself, said once, as
    does one whose poster ended first. A group shut down fails a poster's waiting call, as
    Ray's barrier fails its waiters."""
    import subprocess
    import sys

    from scripts.local_cluster import node_env

    done = subprocess.run([sys.executable, "-c", NODE_AGREEMENT_CHECK, ray_head.address,
                           str(tmp_path)], capture_output=True, text=True, env=node_env(),
                          timeout=300, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["installed"] is True

    def rank_0s(world):
        return [[[None, ["from", 0, 1]]] * world, [["notice marked on 0", ["from", 0, 2]]] * world]

    three, one, apart = seen["three_nodes"], seen["one_node"], seen["no_shared_disk"]
    assert three["agreed"] == rank_0s(6) and three["calls"] == [3, 3, 3], three
    assert one["agreed"] == rank_0s(4) and one["calls"] == [1, 1, 1], one  # rank 0's, not waited
    assert apart["agreed"] == rank_0s(4) and apart["calls"] == [3, 3, 3], apart
    assert len([w for w in seen["warned"] if "rank 3 finds no folder" in w]) == 1, seen["warned"]
    assert seen["first_ended"] == [[None, ["from", 0, 1]]] * 2 + [[None, ["from", 0, 2]], None,
                                                                  [None, ["from", 0, 2]]]
    # What the other nodes waited (rank 0's checks are paced by it); the posters' folders gone
    assert three["waited"] > 0 and one["waited"] == 0, (three, one)
    assert not three["left"] + one["left"] + apart["left"]
    assert "SynchronizationBarrierResetError: the worker group's synchronization barrier was " \
           "shut down" in seen["at_shutdown"], seen
