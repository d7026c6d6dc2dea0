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
        self._samples += int(samples)
        self._points.append((step, metrics))
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
