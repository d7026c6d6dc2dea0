"""What Ray Train's workers hold in place of their group's synchronization actor's handle when
the barrier lives in the controller (controller_barrier.py): imported by every worker, so it
imports nothing of Ray Train."""

from __future__ import annotations

from typing import Any

import ray

CONTROLLER_CALL_TIMEOUT_S = 60.0  # the controller's own calls (a preemption's, a reset) are quick

# The barriers' host, in a controller's process that holds them (set by controller_barrier.py).
local_host: Any = None


class HostedBarrier:
    """``barrier.method.remote(...)`` as on Ray's actor: the call goes to the controller."""

    def __init__(self, controller, key: int):
        self.controller = controller
        self.key = key

    def __getattr__(self, method: str) -> _Call:
        if method.startswith("_"):
            raise AttributeError(method)
        return _Call(self, method)


class _Call:
    def __init__(self, barrier: HostedBarrier, method: str):
        self.barrier = barrier
        self.method = method

    def remote(self, *args, **kwargs) -> ray.ObjectRef:
        host = local_host
        if host is not None and host.handle._actor_id == self.barrier.controller._actor_id:
            # The controller's own call, made from its event loop, which then ray.get()s what
            # this returns: a call through the actor would wait for that same loop.
            future = host.submit(self.barrier.key, self.method, args, kwargs)
            return ray.put(future.result(timeout=CONTROLLER_CALL_TIMEOUT_S))
        return self.barrier.controller.barrier_call.remote(self.barrier.key, self.method,
                                                           args, kwargs)
