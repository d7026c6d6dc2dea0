"""Worker processes started ahead of need: the raylet's PrestartWorkers call (the one Ray
Data uses; Ray's public API does not offer it).

A restart after a failure starts a new worker group: each new worker is an actor, and an
actor gets a new process (Python and Ray imported: ~2 s of a 5 s recovery on 2 cores,
scripts/bench.py recovery) unless its node has an idle one of the same job and runtime
environment. A training worker asks its own node for one such process, like itself, a while
after its start (orchestrator/worker/spare.py); the restart's worker on that node
then starts in it. Kept idle until the job ends (the raylet does not reap it meanwhile).
"""

from __future__ import annotations

# How long the raylet keeps an unused process started ahead from its idle-process reaping:
# the run's whole length (the job's end takes it anyway).
KEEP_ALIVE_S = 30 * 24 * 3600
STARTING_MARK = b"default_worker.py"  # a worker process's command line until it registers


def prestart_like_this_process(count: int = 1) -> str | None:
    """Ask this node's raylet for ``count`` idle Python worker processes of this process's
    job and runtime environment. Returns why not (a speed-up only: nothing else changes), or
    None."""
    try:
        import ray

        env = ray.get_runtime_context().get_runtime_env_string()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return prestart(env, count)


def prestart(runtime_env: str, count: int, keep_alive_s: float = KEEP_ALIVE_S) -> str | None:
    """Ask this node's raylet for ``count`` idle Python worker processes of this process's job
    with the serialized ``runtime_env`` (as Ray's actor table records an actor's), kept from
    idle reaping ``keep_alive_s``. Returns why not, or None."""
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
            runtime_env_info=RuntimeEnvInfo(serialized_runtime_env=runtime_env),
            keep_alive_duration_secs=int(keep_alive_s), num_workers=count)
        with grpc.insecure_channel(f"{node.node_ip_address}:{node.node_manager_port}") as channel:
            node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(
                request, timeout=10, metadata=_get_authentication_metadata_tuple())
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return None
