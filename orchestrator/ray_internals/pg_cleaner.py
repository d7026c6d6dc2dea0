"""The placement groups of a sweep's dead trials, removed by the sweep's driver.

Ray removes a placement group with the job that made it, not with the actor: a trial's Ray
Train controller makes its workers' group, and when Tune stops a trial early (its actor and
the controller with it killed) the group would hold its CPUs until the whole sweep ends,
and the next trials would wait for them. Ray Train's answer is a PlacementGroupCleaner, a
detached actor per run that watches its controller: a process importing Ray (~1.5 CPU-seconds
here) for every trial.

Instead, each trial's controller writes its worker groups into Ray's internal key-value
store (``RegisteredGroupsCallback``, a Ray Train callback), and the sweep's driver, which
outlives every trial, removes the groups whose controller is dead, about once a second
(``remove_orphaned_groups``, called from orchestrator/sweep/placement_groups.py). A
controller that ends normally removes its own group, and its entry goes on the next pass.

When the sweep ends (all trials done, or a Ctrl-C), the driver waits for its trials'
controllers to be gone and then removes every placement group its job still holds
(``release_the_jobs_groups``): a Ctrl-C'd sweep on a joined cluster once left two groups that
controllers stopping with the job had just made, holding the head's CPUs until it restarted
(Ray removes a job's groups as the job ends, not those made while it ends).

Private Ray interfaces (the internal key-value store, the GCS actor and placement group
tables, Ray Train's callback classes): tests/test_ray_internals.py checks them against the
installed Ray.
"""

from __future__ import annotations

import logging
import time

import ray
from ray._private import state as ray_state
from ray.experimental import internal_kv
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

log = logging.getLogger("orchestrator")

NAMESPACE = b"orchestrator"
PREFIX = "trial-placement-group:"


def key_prefix() -> bytes:
    """This job's entries (a sweep's trials run in its driver's job)."""
    return f"{PREFIX}{ray.get_runtime_context().get_job_id()}:".encode()


def register(group: PlacementGroup, controller_id: str) -> None:
    internal_kv._internal_kv_put(key_prefix() + group.id.hex().encode(), controller_id.encode(),
                                 namespace=NAMESPACE)


class RegisteredGroupsCallback(ControllerCallback, WorkerGroupCallback):
    """In a trial's controller: each worker group's placement group, with the controller's
    actor id, for the sweep's driver to remove once the controller is dead."""

    def after_worker_group_start(self, worker_group) -> None:
        try:
            group = worker_group.get_worker_group_state().placement_group_handle.placement_group
            register(group, ray.get_runtime_context().get_actor_id())
        except Exception as exc:  # noqa: BLE001  (a missed entry costs CPUs, not the run)
            log.warning("the sweep cannot remove this trial's placement group if it is "
                        "stopped: %s", exc)


def group_by_id(group_id: str) -> PlacementGroup:
    return PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id)))


def controller_dead(actor_id: str) -> bool:
    info = ray_state.actors(actor_id=actor_id)
    return not info or info.get("State") == "DEAD"


def remove_orphaned_groups() -> list[str]:
    """Remove this job's registered placement groups whose controller is dead (a group its
    controller removed itself is only forgotten); return the ids of those removed."""
    removed = []
    prefix = key_prefix()
    for key in internal_kv._internal_kv_list(prefix, namespace=NAMESPACE):
        controller = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
        if controller is not None and not controller_dead(controller.decode()):
            continue
        group_id = key[len(prefix):].decode()
        group = group_by_id(group_id)
        if placement_group_table(group).get("state", "REMOVED") != "REMOVED":
            remove_placement_group(group)
            removed.append(group_id)
        internal_kv._internal_kv_del(key, namespace=NAMESPACE)
    if removed:
        log.info("removed the placement groups of %d stopped trials", len(removed))
    return removed


# Ray Train's controller actor's class (its name ends so whatever module defines it).
CONTROLLER_CLASS_SUFFIX = "TrainController"


def live_controllers() -> list[str]:
    """This job's Ray Train controllers not yet dead (the trials' own, starting or stopping)."""
    job = ray.get_runtime_context().get_job_id()
    return [actor_id for actor_id, info in ray_state.actors().items()
            if info.get("JobID") == job and info.get("State") != "DEAD"
            and str(info.get("ActorClassName", "")).endswith(CONTROLLER_CLASS_SUFFIX)]


def groups_of_this_job() -> list[str]:
    """The placement groups this job made that Ray has not removed (ids)."""
    from ray.core.generated import gcs_pb2

    job = bytes.fromhex(ray.get_runtime_context().get_job_id())
    accessor = ray_state.state._connect_and_get_accessor()
    held = []
    for raw in accessor.get_placement_group_table():
        info = gcs_pb2.PlacementGroupTableData.FromString(raw)
        if info.creator_job_id == job and info.state != gcs_pb2.PlacementGroupTableData.REMOVED:
            held.append(info.placement_group_id.hex())
    return held


def release_the_jobs_groups(wait_s: float = 30.0, poll_s: float = 0.2) -> list[str]:
    """At a sweep's end: once no controller of its job is alive (up to ``wait_s``), remove
    every placement group the job still holds, and forget the registered ones; the ids of
    those removed."""
    deadline = time.monotonic() + wait_s
    while live_controllers() and time.monotonic() < deadline:
        time.sleep(poll_s)
    removed = []
    for group_id in groups_of_this_job():
        remove_placement_group(group_by_id(group_id))
        removed.append(group_id)
    for key in internal_kv._internal_kv_list(key_prefix(), namespace=NAMESPACE):
        internal_kv._internal_kv_del(key, namespace=NAMESPACE)
    if removed:
        log.info("removed %d placement groups the sweep's stopped trials still held",
                 len(removed))
    return removed
