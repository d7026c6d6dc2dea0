"""Is a worker's exception worth another restart? A pure decision over the failure history.

A lost process or node is retried (Ray Train restarts the group from the newest checkpoint).
An exception raised by the training code that repeats at the same step, with the same type
and message, is a bug, not bad luck: the run stops there instead of burning every restart.
An exception whose class says ``retry = False`` (a NaN loss: the same data gives the same NaN)
stops the run the first time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerError:
    rank: int
    step: int  # steps completed when it was raised
    kind: str  # exception type name
    message: str  # its first line
    traceback: str
    pid: int | None = None  # the worker process: which worker group it belonged to
    retry: bool = True  # False: the exception says a restart would only repeat it

    def same_failure(self, other: WorkerError) -> bool:
        return (self.step, self.kind, as_compared(self.message)) == \
            (other.step, other.kind, as_compared(other.message))


# A library's own clock before its message (XGBoost's "[00:07:16] ..."): the same error a
# second later is the same error.
CLOCK = re.compile(r"^\s*\[\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?\]\s*")
# What differs between two worker processes raising the same bug: an object's address
# (<Foo object at 0x7f..>), the worker's own folder (/tmp/orchestrator-rank0-x1y2/...), the
# DataLoader process that met it. Not every number: a peer's port in the "connection reset"
# errors the survivors of a kill raise must keep those apart.
PER_PROCESS = [(re.compile(r"0x[0-9a-fA-F]+"), "0x?"),
               (re.compile(r"orchestrator-rank\d+-\w+"), "orchestrator-rank?"),
               (re.compile(r"(DataLoader worker process) \d+"), r"\1 ?")]


def as_compared(message: str) -> str:
    message = CLOCK.sub("", message)
    for pattern, stand_in in PER_PROCESS:
        message = pattern.sub(stand_in, message)
    return message


@dataclass(frozen=True)
class Verdict:
    permanent: bool
    reason: str


def classify(earlier_attempts: list[WorkerError], new: WorkerError) -> Verdict:
    """earlier_attempts: the errors of worker groups before the one that raised ``new`` (the
    other ranks of the same group often fail alike at once; that is not a repeat)."""
    if not new.retry:
        return Verdict(True, f"PERMANENT, since {new.kind} at step {new.step} says a restart "
                             "would repeat it")
    repeats = [e for e in earlier_attempts if e.same_failure(new)]
    if repeats:
        return Verdict(True, f"PERMANENT, since {new.kind} at step {new.step} happened "
                             f"{len(repeats) + 1} times in a row of restarts")
    return Verdict(False, f"RETRY, since {new.kind} at step {new.step} is new")
