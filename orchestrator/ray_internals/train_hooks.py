"""Ray Train 2.60's private hooks and environment knobs the driver uses, each with a public
fallback: a renamed hook costs what it saved, not the run. tests/test_ray_internals.py checks
every one against the installed Ray, so an upgrade that renames one fails there, by name.
"""

from __future__ import annotations

import logging
import os
import signal

import ray

from orchestrator.driver.backends import Backend
from orchestrator.ray_internals.knobs import (
    HEALTH_CHECK_INTERVAL,
    PREEMPTION_WATCHER,
    WORKER_HEALTH_CHECK_TIMEOUT,
)

log = logging.getLogger(__name__)

# How often Ray Train's controller polls the workers (its default: 2 s). The poll is how it
# learns that training finished or a worker died: half the interval, on average, comes off the
# end of every run and off every recovery. Each poll costs the controller CPU: at 0.25 s its
# process took 1.46 CPU-s against 1.2 at 1 s over a 10 s run (scripts/run_cpu.py
# trainer.epochs=60); 0.5 s gives most of the time for a third of that. Set in the
# environment, the user's value wins.
POLL_INTERVAL_S = "0.5"


def controller_env(hang_timeout_s: float, backend: Backend) -> dict[str, str]:
    """Ray Train's own knobs, read by its controller: a silent worker fails after
    failure.hang_timeout_s (Ray's default is 10 minutes); the workers are polled every
    POLL_INTERVAL_S; the backend may add some."""
    return {WORKER_HEALTH_CHECK_TIMEOUT: str(hang_timeout_s),
            HEALTH_CHECK_INTERVAL: os.environ.get(HEALTH_CHECK_INTERVAL, POLL_INTERVAL_S),
            **backend.controller_env}


class Controller:
    """Ray Train's controller actor, once fit() has made it: what the driver may ask of it."""

    def __init__(self) -> None:
        self.handle = None

    def abort(self, timeout_s: float = 30.0) -> None:
        """Stop the run's workers and the controller (fit() then raises RayActorError). A
        controller busy waiting for a placement group does not answer: it is killed."""
        if self.handle is None or not ray.is_initialized():
            return
        try:
            ray.get(self.handle.abort.remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(self.handle, no_restart=True)
        except Exception:  # already gone: the driver goes on anyway
            pass

    def stop(self) -> None:
        self.abort(timeout_s=5.0)


def interrupted_by_ctrl_c(ray_trainer) -> Controller:
    """Ray Train 2.60's own SIGINT handler aborts the controller and then exits the driver
    (with code 1, nothing said, no record finished). Ours aborts it too, then raises
    KeyboardInterrupt in fit(): the command says what is kept, finishes the run record and
    exits 130, as for a Ctrl-C at any other moment. A private hook, as above. Returns the
    controller, known once fit() has made it."""
    controller = Controller()

    def register(handle) -> None:
        controller.handle = handle

        def on_sigint(signum, frame):
            # A second Ctrl-C is Python's plain KeyboardInterrupt.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            controller.abort()
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, on_sigint)

    ray_trainer._register_sigint_handler = register
    return controller


# Whether this process set Ray's preemption-watcher switch (a later run of a sweep's process
# then sees it set, but not by the user).
_watcher_switched_here = False


def without_unneeded_actors(ray_trainer, keep_cleaner: bool) -> None:
    """Ray Train 2.60 starts a helper actor (a process importing Ray: ~2 CPU-seconds and
    ~170 MiB here) for each of these on every run, needed or not:
    - DatasetManager, with Ray Datasets or without: the orchestrator's workers load their
      data themselves and never pass any;
    - PlacementGroupCleaner, which removes the workers' placement group if the controller
      dies while the driver lives on. A command's driver ends with its run, and Ray removes
      the placement groups of a job's actors when the job ends (tests/test_ray_internals.py).
      A sweep's trials (``keep_cleaner``), whose driver outlives many controllers, register
      their groups instead, and the sweep's driver removes a dead trial's
      (ray_internals/pg_cleaner.py): no cleaner process per trial either.
    And one more on every worker group's start, a restart's included: the PreemptionWatcher,
    run instead as a thread of the controller (ray_internals/preemption_watch.py), unless the
    user set Ray's switch for it (then Ray's way, as they chose).
    A private hook: if a Ray upgrade renames it, nothing changes but the cost."""
    create = getattr(ray_trainer, "_create_default_callbacks", None)
    try:
        from ray.train.v2._internal.callbacks import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import (
            PlacementGroupCleanerCallback,
        )

        from orchestrator.ray_internals.pg_cleaner import RegisteredGroupsCallback
        from orchestrator.ray_internals.preemption_watch import PreemptionWatchThread
    except ImportError:
        return
    if create is None:
        return
    watch_thread = _watcher_switched_here or PREEMPTION_WATCHER not in os.environ
    unneeded: tuple[type, ...] = () if getattr(ray_trainer, "datasets", None) else (DatasetsCallback,)

    def adjusted() -> list:
        callbacks = []
        for cb in create():
            if isinstance(cb, unneeded):
                continue
            if type(cb) is PlacementGroupCleanerCallback:
                if not keep_cleaner:
                    continue
                cb = RegisteredGroupsCallback()
            callbacks.append(cb)
        if watch_thread:
            # Ray's switch goes with the thread that replaces its watcher: fit() passes the
            # driver's value on to the controller it starts right after this call.
            global _watcher_switched_here
            os.environ[PREEMPTION_WATCHER] = "0"
            _watcher_switched_here = True
            callbacks.append(PreemptionWatchThread())
        return callbacks

    ray_trainer._create_default_callbacks = adjusted


def with_plain_framework_versions(ray_trainer) -> None:
    """The Train page's versions answered in plain strings (ray_internals/train_page.py), so
    that the controller does not import torch to read them. A private hook: if a Ray upgrade
    renames it, nothing changes but the cost."""
    create = getattr(ray_trainer, "_create_default_callbacks", None)
    try:
        from orchestrator.ray_internals.train_page import (
            PlainVersionsStateManager,
            StateManagerCallback,
        )
    except (ImportError, AttributeError):
        return
    if create is None:
        return

    def adjusted() -> list:
        return [PlainVersionsStateManager.of(cb) if type(cb) is StateManagerCallback else cb
                for cb in create()]

    ray_trainer._create_default_callbacks = adjusted


def without_autoscaling_requests(ray_trainer) -> None:
    """A fixed-size run on an embedded cluster asks no autoscaler for its workers' resources
    (there is none): Ray Train's controller then starts no AutoscalingCoordinator actor. The
    policy fit() makes is swapped where fit() hands it to the controller (a private hook: if a
    Ray upgrade renames it, nothing changes but the cost)."""
    start = getattr(ray_trainer, "_initialize_and_run_controller", None)
    try:
        from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy

        from orchestrator.ray_internals.scaling import FixedWithoutRequests
    except ImportError:
        return
    if start is None:
        return

    def initialize_and_run_controller(**kwargs):
        policy = kwargs.get("scaling_policy")
        if type(policy) is FixedScalingPolicy:
            kwargs["scaling_policy"] = FixedWithoutRequests(policy.scaling_config)
        return start(**kwargs)

    ray_trainer._initialize_and_run_controller = initialize_and_run_controller


def elastic_in_multiples(ray_trainer, multiple: int) -> None:
    """An elastic run's worker groups sized in whole multiples of ``multiple`` (a model copy's
    workers): the policy fit() makes is swapped where fit() hands it to the controller. A
    private hook, for correctness: where a Ray upgrade moved it, a group of another size is
    refused by the trainer in one line (trainers/pytorch/mesh.py, MeshRefused)."""
    start = getattr(ray_trainer, "_initialize_and_run_controller", None)
    if start is None:
        return
    from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy

    from orchestrator.ray_internals.scaling import in_multiples

    def initialize_and_run_controller(**kwargs):
        policy = kwargs.get("scaling_policy")
        if isinstance(policy, ElasticScalingPolicy):
            kwargs["scaling_policy"] = in_multiples(policy, multiple)
        return start(**kwargs)

    ray_trainer._initialize_and_run_controller = initialize_and_run_controller


def with_barrier_in_controller() -> bool:
    """Ray Train's worker groups keep their synchronization barrier in the controller's process
    instead of an actor each (ray_internals/controller_barrier.py). False where a Ray upgrade
    moved what that needs: its actor then starts as before."""
    try:
        from orchestrator.ray_internals import controller_barrier
    except (ImportError, AttributeError):  # what it takes from Ray moved (an upgrade)
        return False
    return controller_barrier.with_barrier_in_controller()


# Calls Ray lets an async actor (Ray Train's controller, its barrier actor) take at once.
RAYS_ASYNC_CALLS = 1000


def barrier_room(ranks: int, barrier_in_controller: bool) -> list[str]:
    """Room at the barrier for every rank's call at once (controller_barrier.room_for): the
    line to warn with where a run this large may hang at its first collective instead."""
    if barrier_in_controller:
        from orchestrator.ray_internals import controller_barrier

        if ranks + controller_barrier.OWN_CALLS <= RAYS_ASYNC_CALLS or \
                controller_barrier.room_for(ranks):
            return []
    elif ranks < RAYS_ASYNC_CALLS:
        return []
    return [f"Ray Train's barrier takes about {RAYS_ASYNC_CALLS} ranks' calls at once: with "
            f"cluster.workers={ranks} the run may hang at its first collective (its barrier is "
            "Ray's own actor here, or Ray moved the default the orchestrator raises)"]


def with_workers_started_ahead(ray_trainer, barrier_in_controller: bool) -> None:
    """The first worker group's processes start as soon as the controller's has, beside its
    set-up (ray_internals/group_prestart.py): for a fixed-size run on an embedded cluster (one
    node, a job that ends with the run). A private hook, and Ray's runtime environments
    rebuilt: if a Ray upgrade changes either, the processes go unused and the run starts its
    own."""
    start = getattr(ray_trainer, "_initialize_and_run_controller", None)
    workers = getattr(getattr(ray_trainer, "scaling_config", None), "num_workers", None)
    if start is None or not isinstance(workers, int):
        return

    def ask_ahead() -> None:
        from orchestrator.ray_internals.group_prestart import (
            group_runtime_envs,
            prestart_beside_controller,
        )

        cluster = ray.cluster_resources()
        if any(need > cluster.get(name, 0) + 1e-9
               for name, need in ray_trainer.scaling_config.total_resources.items()):
            return  # a group that cannot be placed takes no process
        controller, worker = group_runtime_envs(
            ray.get_runtime_context().get_runtime_env_string(),
            ray_trainer.run_config.worker_runtime_env or {})
        slots = max(1, int(cluster.get("CPU", 1)))  # the raylet's startup concurrency
        # The workers first (each imports its framework), then the synchronization actor,
        # where the group starts one.
        barrier = [] if barrier_in_controller else [(controller, 1)]
        prestart_beside_controller([(worker, workers), *barrier], slots)

    def initialize_and_run_controller(**kwargs):
        # The environment as fit() leaves it right before it starts the controller (its
        # callbacks set variables the controller inherits).
        try:
            ask_ahead()
        except Exception as exc:  # noqa: BLE001  (a speed-up only)
            log.debug("workers not started ahead: %s", exc)
        return start(**kwargs)

    ray_trainer._initialize_and_run_controller = initialize_and_run_controller


def with_permanent_errors_raised(ray_trainer, recorder) -> None:
    """A worker error the run's recorder judged permanent ends fit() at once, instead of
    after a worker group started for nothing (ray_internals/failure_decisions.py). Without
    the hook those workers still return at once: the run ends the same, later."""
    start = getattr(ray_trainer, "_initialize_and_run_controller", None)
    if start is None:
        return

    def initialize_and_run_controller(**kwargs):
        from orchestrator.ray_internals.failure_decisions import StopOnPermanentErrors

        policy = kwargs.get("failure_policy")
        if policy is not None:
            kwargs["failure_policy"] = StopOnPermanentErrors(policy, recorder)
        return start(**kwargs)

    ray_trainer._initialize_and_run_controller = initialize_and_run_controller


def hooks_missing(ray_trainer, speed: bool = True) -> list[str]:
    """What a Ray upgrade took away from the hooks above, one line each (the run goes on
    without what the hook gave): said once by the driver, and kept in run.json's warnings.
    ``speed``: the speed hooks were asked for (not on a Ray outside the tested range)."""
    missing = []
    trainer_class = type(ray_trainer)
    if not callable(getattr(trainer_class, "_register_sigint_handler", None)):
        missing.append("Ray Train's SIGINT hook (_register_sigint_handler) is gone: a Ctrl-C "
                       "stops the run without finishing run.json")
    if speed:
        missing += speed_hooks_missing(trainer_class)
    if not callable(getattr(trainer_class, "_initialize_and_run_controller", None)):
        missing.append("Ray Train's controller hook (_initialize_and_run_controller) is gone: "
                       "its AutoscalingCoordinator actor starts on every run, and a permanent "
                       "worker error starts one more worker group before the run stops")
    return missing


def speed_hooks_missing(trainer_class) -> list[str]:
    missing = []
    try:
        from ray.train.v2._internal.callbacks import DatasetsCallback  # noqa: F401
        from ray.train.v2._internal.callbacks.placement_group_callback import (  # noqa: F401
            PlacementGroupCleanerCallback,
        )

        from orchestrator.ray_internals import preemption_watch  # noqa: F401
        usable = callable(getattr(trainer_class, "_create_default_callbacks", None))
    except ImportError:
        usable = False
    if not usable:
        missing.append("Ray Train's default-callback hook (_create_default_callbacks) is gone: "
                       "its DatasetManager and PlacementGroupCleaner actors start on every run, "
                       "its PreemptionWatcher actor on every worker group's start")
    try:
        from orchestrator.ray_internals import controller_barrier

        barrier_here = controller_barrier.installed()
    except (ImportError, AttributeError):
        barrier_here = False
    if not barrier_here:
        missing.append("Ray Train's synchronization actor can no longer be kept in its "
                       "controller (ray_internals/controller_barrier.py): one starts with "
                       "every worker group")
    return missing
