"""Ray Train's synchronization barrier kept in its controller's process, not an actor per group.

Ray Train 2.60 starts a SynchronizationActor for every worker group, a restart's included: a
process importing Ray and Ray Train, ~1.4 CPU-s here (`scripts/bench.py fixed_cost`'s CPU
profile), on the cores the group's workers are starting on. What it holds is a barrier (an
asyncio condition and rank 0's value of the collective in progress), called by the workers at
each collective (ray.train.collective, get_preemption_info, report) and by the controller at a
preemption (set_required_ranks) and a replica group's replacement (reset). Here Ray's own class
runs in the controller's process instead: a barrier per worker group, as Ray's, reached
through the controller's actor handle (the controller is an async actor: the workers' calls
wait there without holding anything).

The barriers run on an event loop thread of their own, not the controller's: the controller's
loop blocks in ray.get while it polls its workers, and its own calls to a barrier are made
from that loop (a ray.get of what the call returns). A worker's call still enters through the
controller's loop (an async actor method), so it waits while that loop is blocked: a poll of
the workers (milliseconds; at most the health check's timeout when a worker does not answer),
a group's start or shutdown. Ray's actor answered at once; a collective here may take that
much longer, never forever (every blocking call of the controller has a timeout).

The controller class Ray Train starts is swapped for a subclass that holds them
(``with_barrier_in_controller``, a private module global of Ray's); where the swap is
missing, Ray's actor starts as before.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import threading
from concurrent.futures import Future
from typing import Any

import ray
from ray.train.v2._internal.execution.checkpoint.sync_actor import (
    SynchronizationActor,
    SynchronizationBarrierResetError,
)
from ray.train.v2._internal.execution.controller import controller as controller_module
from ray.train.v2._internal.execution.worker_group import state as group_state
from ray.train.v2._internal.execution.worker_group import worker_group as group_module

from orchestrator.ray_internals import barrier_handle
from orchestrator.ray_internals.barrier_handle import HostedBarrier
from orchestrator.ray_internals.check_answers import Answers

RaySynchronizationActor = SynchronizationActor
_Barrier = SynchronizationActor.__ray_metadata__.modified_class.__bases__[0]  # the class Ray runs
_ray_shutdown_sync_actor = group_state._shutdown_sync_actor


class _Host:
    """This controller's worker groups' barriers, on a loop thread of their own."""

    def __init__(self) -> None:
        self.handle = ray.get_runtime_context().current_actor
        self.loop = asyncio.new_event_loop()
        self.barriers: dict[int, Any] = {}
        self.answers: dict[int, Answers] = {}  # rank 0's answers to the group's checks
        self._keys = itertools.count()
        threading.Thread(target=self.loop.run_forever, name="train-barriers", daemon=True).start()

    def new(self, options: dict) -> HostedBarrier:
        key = next(self._keys)
        self.barriers[key] = _Barrier(**options)
        self.answers[key] = Answers(options.get("timeout_s"))
        return HostedBarrier(self.handle, key)

    def answers_of(self, key: int) -> Answers:
        answers = self.answers.get(key)
        if answers is None:
            raise SynchronizationBarrierResetError(
                "the worker group's synchronization barrier was shut down")
        return answers

    def submit(self, key: int, method: str, args: tuple, kwargs: dict) -> Future:
        async def call():
            barrier = self.barriers.get(key)
            if barrier is None:
                raise SynchronizationBarrierResetError(
                    "the worker group's synchronization barrier was shut down")
            result = getattr(barrier, method)(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result

        return asyncio.run_coroutine_threadsafe(call(), self.loop)

    def drop(self, key: int) -> None:
        """The group is shut down (Ray kills its actor): its waiters raise, later calls too."""
        barrier = self.barriers.pop(key, None)
        if barrier is not None:
            asyncio.run_coroutine_threadsafe(barrier.reset(), self.loop)
        answers = self.answers.pop(key, None)
        if answers is not None:
            answers.close(SynchronizationBarrierResetError(
                "the worker group's synchronization barrier was shut down"))


_host_lock = threading.Lock()
_in_this_class = False  # whether this process runs the controller class below


def _this_host() -> _Host:
    with _host_lock:
        if barrier_handle.local_host is None:
            barrier_handle.local_host = _Host()
        return barrier_handle.local_host


class TrainController(controller_module.TrainController):
    """Ray Train's controller, holding its worker groups' synchronization barriers."""

    def __init__(self, *args, **kwargs):
        global _in_this_class
        _in_this_class = True
        super().__init__(*args, **kwargs)

    async def barrier_call(self, key: int, method: str, args: tuple, kwargs: dict) -> Any:
        return await asyncio.wrap_future(_this_host().submit(key, method, args, kwargs))

    # The workers' preemption checks (preemption_agreement.py): rank 0's answer, and each
    # other node's call for it, on this loop (no hop to the barriers' thread).
    async def agreement_publish(self, key: int, check: int, answer: Any) -> float:
        return _this_host().answers_of(key).publish(check, answer)

    async def agreement_answer(self, key: int, check: int, waited_s: float = 0.0) -> Any:
        return await _this_host().answers_of(key).answer(check, waited_s)


class _SynchronizationActorHere:
    """What the worker group's module calls SynchronizationActor, in the controller's process:
    ``.options(...).remote(...)`` makes a barrier in this controller (one of the class above),
    or Ray's actor (any other)."""

    def options(self, **actor_options) -> _SynchronizationActorHere._Options:
        return self._Options(actor_options)

    class _Options:
        def __init__(self, actor_options: dict):
            self.actor_options = actor_options

        def remote(self, **kwargs):
            if _in_this_class:
                return _this_host().new(kwargs)
            return RaySynchronizationActor.options(**self.actor_options).remote(**kwargs)


def _shutdown_sync_actor(sync_actor) -> None:
    if isinstance(sync_actor, HostedBarrier):
        _this_host().drop(sync_actor.key)
    else:
        _ray_shutdown_sync_actor(sync_actor)


def with_barrier_in_controller() -> bool:
    """Ray Train's fit() starts this module's controller class (its trainer module's private
    global): a run's worker groups then start no synchronization actor. False where a Ray
    upgrade moved what this needs (Ray's actor then starts as before)."""
    from ray.train.v2.api import data_parallel_trainer

    if not installed():
        return False
    data_parallel_trainer.TrainController = TrainController
    return True


# Calls a controller takes beside its ranks' (its own run, the driver's and the watcher's).
OWN_CALLS = 100


def room_for(ranks: int) -> bool:
    """Ray Train's controller admits a call from each of ``ranks`` at once. A collective (the
    preemption agreement, a report's barrier) holds every rank's call at the barrier until the
    last rank's arrives, and Ray starts an async actor (the controller is one) with room for
    1,000 calls at once: at ~1,000 ranks the last ranks' calls wait behind the calls that wait
    for them, and the run hangs at its first collective (scripts/bench.py scale). Ray's
    default for the async actors this process starts (a private module global, read as
    fit() starts the controller) is raised to fit; never lowered. False where a Ray upgrade
    moved it (a run that large then hangs as Ray's own barrier actor would)."""
    import ray.actor

    default = getattr(ray.actor, "DEFAULT_MAX_CONCURRENCY_ASYNC", None)
    if not isinstance(default, int):
        return False
    ray.actor.DEFAULT_MAX_CONCURRENCY_ASYNC = max(default, ranks + OWN_CALLS)
    return True


def installed() -> bool:
    from ray.train.v2.api import data_parallel_trainer

    return (getattr(data_parallel_trainer, "TrainController", None)
            in (controller_module.TrainController, TrainController)
            and isinstance(group_module.SynchronizationActor, _SynchronizationActorHere)
            and group_state._shutdown_sync_actor is _shutdown_sync_actor)


if getattr(group_module, "SynchronizationActor", None) is RaySynchronizationActor and callable(
        getattr(group_state, "_shutdown_sync_actor", None)):
    group_module.SynchronizationActor = _SynchronizationActorHere()
    group_state._shutdown_sync_actor = _shutdown_sync_actor
