"""Worker processes started ahead of need: the raylet's PrestartWorkers call (the one Ray
Data uses; Ray's public API does not offer it). Ray starts the processes of this job's
runtime environment at once, while the driver goes on planning, and gives them to the first
actors of that environment it places on the node: the run's training workers then start in a
process that has already imported Ray, not a new one (orchestrator/driver/warm_start.py)."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def prestart_workers(count: int, keep_alive_s: int, env_vars: dict[str, str]) -> str | None:
    """Ask this node's raylet for ``count`` Python worker processes of the current job whose
    runtime environment is ``env_vars``, kept ``keep_alive_s`` seconds if unused. Returns why
    not, or None."""
    try:
        import grpc
        import ray
        from ray._private.authentication.grpc_authentication_client_interceptor import (
            _get_authentication_metadata_tuple,
        )
        from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc
        from ray.core.generated.runtime_environment_pb2 import RuntimeEnvInfo

        worker = ray._private.worker.global_worker
        node = worker.node
        request = node_manager_pb2.PrestartWorkersRequest(
            language=common_pb2.PYTHON, job_id=worker.current_job_id.binary(),
            runtime_env_info=RuntimeEnvInfo(serialized_runtime_env=actor_runtime_env(env_vars)),
            keep_alive_duration_secs=keep_alive_s, num_workers=count)
        with grpc.insecure_channel(f"{node.node_ip_address}:{node.node_manager_port}") as channel:
            node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(
                request, timeout=10, metadata=_get_authentication_metadata_tuple())
    except Exception as exc:  # a speed-up only: the run goes on without it
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return None


def actor_runtime_env(env_vars: dict[str, str]) -> str:
    """The runtime environment of an actor given ``{"env_vars": ...}`` explicitly (as Ray
    Train gives its workers), as Ray's core worker writes it once merged with the job's: JSON
    with sorted keys and no spaces. A worker process is given only to an actor whose string
    is the same (the job's own is written with spaces: an actor without a runtime_env of its
    own matches that one instead)."""
    import json

    return json.dumps({"env_vars": env_vars}, sort_keys=True, separators=(",", ":"))


def train_actor_env(job_env: dict[str, str]) -> dict[str, str]:
    """The environment variables of Ray Train's controller and of every actor it starts (its
    workers with an empty worker_runtime_env, its synchronization actor...): the job's, the
    variables Ray Train passes on from the driver, and the one the controller sets for itself
    (ray/train/v2/api/data_parallel_trainer.py, _initialize_and_run_controller)."""
    from ray.train.v2._internal.constants import (
        DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
        RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
        get_env_vars_to_propagate,
    )

    passed_on = get_env_vars_to_propagate()
    passed_on.setdefault(RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
                         DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE)
    return {**job_env, **passed_on}
