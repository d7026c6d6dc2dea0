"""Rank 0's steps, batched to the run recorder about four times a second.

Each step's metrics are kept (the curves have every step) but read only when sent: a metric
may be a device tensor, and reading it waits for the device, so that happens here and not on
every step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

EVERY_S = 0.25


class StepReports:
    def __init__(self, recorder):
        self.recorder = recorder
        self._samples = 0
        self._points: list[tuple[int, Mapping[str, Any]]] = []
        self._sent_at = 0.0

    def add(self, step: int, metrics: Mapping[str, Any], samples: int, final: bool) -> None:
        for name, value in metrics.items():
            check_metric(step, name, value)
        self._samples += int(samples)
        self._points.append((step, dict(metrics)))  # a copy: a loop may reuse its dict
        first = self._sent_at == 0.0
        if first or final or time.monotonic() - self._sent_at >= EVERY_S:
            self.send()

    def send(self) -> None:
        if not self._points:
            return
        points = [(step, {k: float(v) for k, v in metrics.items()}) for step, metrics in self._points]
        step, metrics = points[-1]
        self.recorder.progress.remote(step, self._samples, metrics, time.time(), points)
        self._samples, self._points = 0, []
        self._sent_at = time.monotonic()


class MetricNotANumber(TypeError):
    """A step's metric that is not one number: said at the step that reported it."""

    retry = False


def check_metric(step: int, name: str, value: Any) -> None:
    """A number, a numpy scalar, or a one-element tensor or array (read later, when sent)."""
    if isinstance(value, (str, bytes, Mapping, list, tuple, set)) or value is None:
        ok = False
    elif hasattr(value, "numel"):  # a tensor: its size only, no device sync
        ok = value.numel() == 1
    elif hasattr(value, "size") and hasattr(value, "dtype"):  # numpy
        ok = value.size == 1 and value.dtype.kind in "biuf"
    else:
        ok = hasattr(value, "__float__")
    if not ok:
        raise MetricNotANumber(f"ctx.step_done({step}, metrics): metrics[{name!r}] = "
                               f"{str(value)[:60]!r} is not a number: a metric is a float, an "
                               "int or a one-element tensor")
