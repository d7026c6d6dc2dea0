"""How many workers, with what resources: pure decisions from the config and cluster size."""

from __future__ import annotations

import math

from orchestrator.config.schema import ClusterConfig
from orchestrator.ray_internals.knobs import WORKER_GROUP_START_TIMEOUT

MIN_CPU_SHARE = 0.01


def cpus_per_worker(cluster: ClusterConfig, cluster_cpus: float) -> float:
    """The configured share, or the cluster's CPUs split among the target number of workers.

    Capped at one CPU: a data-parallel worker on CPU gains little from more, and sixteen
    workers on two cores must each get a fraction to be scheduled at all.
    """
    if cluster.cpus_per_worker is not None:
        return cluster.cpus_per_worker
    return cpu_share(cluster_cpus, cluster.workers)


def cpu_share(cpus: float, workers: int) -> float:
    """CPUs split among workers, rounded down to a hundredth, between MIN_CPU_SHARE and 1
    (a sweep's trial splits its budget the same way: orchestrator/sweep/trial.py)."""
    share = math.floor(cpus / workers * 100) / 100
    return max(MIN_CPU_SHARE, min(1.0, share))


def scaling_kwargs(cluster: ClusterConfig, cluster_cpus: float) -> dict:
    """Keyword arguments for ray.train.ScalingConfig."""
    resources = {"CPU": cpus_per_worker(cluster, cluster_cpus), **cluster.resources}
    if cluster.gpus_per_worker:
        resources["GPU"] = cluster.gpus_per_worker
    kwargs = {
        "num_workers": (cluster.min_workers, cluster.workers) if cluster.elastic else cluster.workers,
        "use_gpu": cluster.gpus_per_worker > 0,
        "resources_per_worker": resources,
        "placement_strategy": cluster.placement,
    }
    if cluster.elastic:
        kwargs["elastic_resize_monitor_interval_s"] = cluster.resize_check_s
    return kwargs


def coordinator_scaling(kwargs: dict) -> dict:
    """A coordinating function (TrainingInfo.coordinates) runs once: one Ray Train worker on
    a hundredth of a CPU (it schedules work and waits); the workers it starts itself take the
    shares of the CPUs (coordinated_cluster)."""
    return {**kwargs, "num_workers": 1, "use_gpu": False,
            "resources_per_worker": {"CPU": MIN_CPU_SHARE}}


def coordinated_cluster(cluster: ClusterConfig, cluster_cpus: float) -> dict:
    """What a coordinating function gets as cfg["cluster"]: how many workers to start, and
    the CPUs they share (it splits them among its workers and servers)."""
    return {"workers": cluster.workers, "cpus_per_worker": cluster.cpus_per_worker,
            "gpus_per_worker": cluster.gpus_per_worker, "cpus": cluster_cpus,
            "resources": dict(cluster.resources)}


def elastic_controller_env(cluster: ClusterConfig, hang_timeout_s: float) -> dict[str, str]:
    """Ray Train's controller knobs for an elastic job. Its elastic policy sizes a new worker
    group from a view of the cluster that still counts a silent (partitioned) node's CPUs as
    free, then waits up to RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (60 s) for a placement group
    that cannot be placed before it tries a smaller size. A placement group with room is ready
    in milliseconds, so an elastic job gives up after failure.hang_timeout_s instead; a fixed
    size has no smaller size to try and keeps Ray's wait."""
    if not cluster.elastic:
        return {}
    return {WORKER_GROUP_START_TIMEOUT: str(hang_timeout_s)}


def unplaceable_here(cluster: ClusterConfig, per_worker: dict[str, float],
                     has: dict[str, float]) -> str | None:
    """On an embedded cluster (this machine's one node, no autoscaler, nothing to grow into):
    the line refusing a worker group that can never be placed, naming the key that asks too
    much; None when it fits. Ray would wait for the room until cluster.placement_timeout_s
    (300 s), then the run failed."""
    workers = cluster.min_workers if cluster.elastic else cluster.workers
    count = f"{workers} workers{' (cluster.min_workers)' if cluster.elastic else ''}"
    for name, each in per_worker.items():
        total = float(has.get(name, 0.0))
        if each * workers <= total + 1e-9:
            continue
        key, value = {"CPU": ("cluster.cpus_per_worker", cluster.cpus_per_worker),
                      "GPU": ("cluster.gpus_per_worker", cluster.gpus_per_worker)}.get(
                          name, (f"cluster.resources.{name}", each))
        if value is None:  # the CPUs split among the workers: their number asks too much
            key, value = "cluster.workers", cluster.workers
        if total <= 0:
            allowed = "ask for none, or join a cluster that has some (cluster.address=...)"
        elif key == "cluster.workers":
            allowed = f"at most {int(total / each)} workers of {each:g} {name}"
        else:
            allowed = f"at most {math.floor(total / workers * 100) / 100:g} with {count}" + (
                ", or null to split them" if name == "CPU" else "")
        num_cpus = " (cluster.num_cpus)" if name == "CPU" else ""
        return (f"{key}={value} is not allowed on this machine's embedded Ray: {count} x "
                f"{each:g} {name} = {each * workers:g} {name}, and it has {total:g}{num_cpus}; "
                f"{allowed}")
    return None
