"""A run's metric values on their way to a tracking server: by step, each step once, in a
bounded buffer that outlasts a server away for a while."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

TRAIN_PREFIX = "train/"


def metric_key(tag: str) -> str:
    """A curve's TensorBoard tag as a tracking key: a training metric by its own name (loss),
    the others as tagged (eval/accuracy, perf/samples_per_s, cluster/world_size)."""
    return tag[len(TRAIN_PREFIX):] if tag.startswith(TRAIN_PREFIX) else tag


@dataclass(frozen=True)
class Value:
    key: str
    value: float
    step: int
    at_ms: int  # kept with the value: a batch sent again is the same batch (the server dedupes)


class PointBuffer:
    """Values in the order they came, at most ``limit`` (then the oldest go, counted).

    A key's steps only go up: a worker group restarted from a checkpoint computes some steps
    again, and a resumed run's MLflow run has them already (``forget_up_to``).
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.dropped = 0
        self._values: deque[Value] = deque()
        self._last_step: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, step: int, values: Mapping[str, float], at: float) -> int:
        """Add one step's values; return how many older values had to go for them."""
        dropped = 0
        with self._lock:
            for tag, value in values.items():
                key = metric_key(tag)
                if value is None or step <= self._last_step.get(key, -1):
                    continue
                self._last_step[key] = step
                self._values.append(Value(key, float(value), int(step), int(at * 1000)))
                if len(self._values) > self.limit:
                    self._values.popleft()
                    dropped += 1
            self.dropped += dropped
        return dropped

    def forget_up_to(self, last_steps: Mapping[str, int]) -> None:
        """Steps a resumed tracking run has already: neither kept nor taken again."""
        with self._lock:
            for key, step in last_steps.items():
                self._last_step[key] = max(step, self._last_step.get(key, -1))
            self._values = deque(v for v in self._values
                                 if v.step > last_steps.get(v.key, -1))

    def peek(self, n: int) -> list[Value]:
        with self._lock:
            return [self._values[i] for i in range(min(n, len(self._values)))]

    def taken(self, values: list[Value]) -> None:
        """Remove what peek() gave, once the server has it (unless the oldest went meanwhile)."""
        with self._lock:
            for value in values:
                if self._values and self._values[0] == value:
                    self._values.popleft()

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)
