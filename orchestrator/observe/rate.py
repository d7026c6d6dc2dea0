"""Throughput over the last few seconds, from the progress reports of rank 0."""

from __future__ import annotations

from collections import deque

WINDOW_S = 10.0


class Rate:
    """Samples per second and seconds per step over a sliding window of reports."""

    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self._points: deque[tuple[float, int, int]] = deque()  # (time, step, samples so far)
        self._samples = 0

    def reset(self) -> None:
        """A new worker group: its start-up pause and replayed steps are not throughput."""
        self._points.clear()

    def add(self, at: float, step: int, samples: int) -> None:
        self._samples += samples
        self._points.append((at, step, self._samples))
        while len(self._points) > 2 and at - self._points[0][0] > self.window_s:
            self._points.popleft()

    def _span(self) -> tuple[float, int, int] | None:
        if len(self._points) < 2:
            return None
        (t0, s0, n0), (t1, s1, n1) = self._points[0], self._points[-1]
        return (t1 - t0, s1 - s0, n1 - n0) if t1 > t0 and s1 > s0 else None

    def samples_per_s(self) -> float | None:
        span = self._span()
        return span[2] / span[0] if span else None

    def step_s(self) -> float | None:
        span = self._span()
        return span[0] / span[1] if span else None
