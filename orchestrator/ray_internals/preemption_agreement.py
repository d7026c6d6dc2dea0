"""The workers' agreement on a preemption notice in one barrier, not two.

Every rank's check (worker_api.WorkerContext._agree, about once a second) asks two things at
once: is there a notice, and rank 0's schedule (the next check, a time-based save, its last
save). Through Ray's public calls that is two barriers: ``ray.train.get_preemption_info()``,
which is itself rank 0's own notice broadcast to every rank, then a broadcast of rank 0's
proposal. Each barrier is one call per rank into the run's controller, 2-3 ms of its CPU each
on a small machine: at 1,024 simulated ranks two barriers took 5.3 s, one 2.6 s
(scripts/bench.py scale, "agreement"; docs/benchmarks.md). Here rank 0 reads its own notice, as the watcher marked it, and sends it
with its proposal in Ray's own preemption collective (the one that may release without
ranks already reclaimed): one call per rank, the same answer on every rank.

tests/test_ray_internals.py checks what this takes from Ray against the installed Ray.
"""

from __future__ import annotations

import inspect
from typing import Any

from ray.train.v2._internal.execution import collective_impl
from ray.train.v2._internal.execution.context import TrainContext, get_train_context

# The collective as ray.train.get_preemption_info makes it: its name, and (Ray 2.60) relaxable,
# so that the barrier releases it without the ranks a preemption already took
# (set_required_ranks); Ray 2.58 has no relaxing.
CALLER = "ray.train.get_preemption_info"


def _parameters() -> set[str]:
    try:
        return set(inspect.signature(collective_impl.broadcast_from_rank_zero).parameters)
    except (TypeError, ValueError):
        return set()


_AS_RAYS = {"relaxable": True} if "relaxable" in _parameters() else {}


def agree(rank: int, proposal: Any) -> tuple[Any, Any]:
    """(the notice rank 0 holds, or None; rank 0's ``proposal``), on every rank, in one
    barrier. (None, None) where the barrier released without rank 0 (its node reclaimed)."""
    notice = get_train_context().preemption_context.preemption_info if rank == 0 else None
    answer = collective_impl.broadcast_from_rank_zero(
        (notice, proposal) if rank == 0 else None, caller_method_name=CALLER, **_AS_RAYS)
    return answer if answer is not None else (None, None)


def installed() -> bool:
    """What this reads is where Ray 2.58-2.60 keep it (checked in the worker, where it runs)."""
    return ("caller_method_name" in _parameters()
            and "preemption_context" in getattr(TrainContext, "__dataclass_fields__", {}))
