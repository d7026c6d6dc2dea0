"""Progress on the driver: a bar on a terminal, plain periodic lines otherwise.

The run recorder (a Ray actor) holds the state; a thread of the driver polls it while
fit() runs and draws. The recorder also queues the orchestrator's own notices (workers
started, checkpoint committed, restart, ...), printed here so they reach the terminal
without Ray's worker-output channel.
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("orchestrator")

BAR_WIDTH = 20
POLL_S = 0.5


@dataclass(frozen=True)
class ProgressState:
    step: int = 0
    total: int | None = None
    world_size: int | None = None
    samples_per_s: float | None = None
    step_s: float | None = None
    metrics: dict = field(default_factory=dict)
    notices: list = field(default_factory=list)  # (level name, message) since the cursor
    cursor: int = 0  # pass back to get only newer notices
    # A coordinating trainer's own words for its processes ("3 workers, 1 parameter server"),
    # shown instead of the count of Ray Train's workers (its one coordinator)
    workers_shown: str | None = None
    # For a tracking server: (step, time, {tag: value}, {run tag: text}) from the cursor
    # asked for, and the cursor that follows them
    tracked: list = field(default_factory=list)
    tracked_cursor: int = 0


def clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def metric_text(value: float, spec: str = ".4g") -> str:
    """A metric's value: a count (workers, tokens) as the integer it is, world=2, not 2.0000
    (a worker's final metrics arrive as floats); anything else in ``spec``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, spec)


def details(state: ProgressState, unit: str = "step") -> list[str]:
    """What follows the count, most wanted first (a narrow terminal cuts the end): ETA,
    throughput, workers, the latest metric, step time."""
    parts = []
    if state.step_s is not None and state.total:
        parts.append(f"ETA {clock(max(0, state.total - state.step) * state.step_s)}")
    if state.samples_per_s:  # none where the run counts no samples (a user's script)
        parts.append(f"{state.samples_per_s:,.0f} samples/s")
    if state.workers_shown:
        parts.append(state.workers_shown)
    elif state.world_size:
        parts.append(f"{state.world_size} worker{'s' if state.world_size != 1 else ''}")
    if state.metrics:
        name, value = next(iter(state.metrics.items()))
        parts.append(f"{name}={metric_text(value)}")
    if state.step_s is not None:
        parts.append(f"{state.step_s:.3g} s/{unit}")
    return parts


def progress_line(state: ProgressState, unit: str = "step") -> str:
    """`step 120/220 (55%) | ETA 0:04 | 1,830 samples/s | 2 workers | loss=0.21 | 0.035 s/step`"""
    count = f"{unit} {state.step}/{state.total}" if state.total else f"{unit} {state.step}"
    if state.total:
        count += f" ({100 * state.step // state.total}%)"
    return " | ".join([count, *details(state, unit)])


def bar_line(state: ProgressState, unit: str = "step", width: int = 100) -> str:
    """`step 120/220 [==========>         ]  55% | ETA 0:04 | 1,830 samples/s | ...`"""
    if state.total:
        filled = min(BAR_WIDTH, BAR_WIDTH * state.step // state.total)
        arrow = ">" if filled < BAR_WIDTH else ""
        bar = "[" + "=" * filled + arrow + " " * (BAR_WIDTH - filled - len(arrow)) + "]"
        head = f"{unit} {state.step}/{state.total} {bar} {100 * state.step // state.total:3d}%"
    else:
        head = f"{unit} {state.step}"
    return " | ".join([head, *details(state, unit)])[: max(20, width - 1)]


class LinesDisplay:
    """One log line every `every_s` seconds, for logs and CI (no terminal control codes)."""

    def __init__(self, unit: str, every_s: float):
        self.unit, self.every_s = unit, every_s
        self._last_at = 0.0
        self._last_step = 0

    def update(self, state: ProgressState, final: bool = False) -> None:
        now = time.monotonic()
        due = now - self._last_at >= self.every_s
        if state.step > self._last_step and (due or final):
            log.info(progress_line(state, self.unit))
            self._last_at, self._last_step = now, state.step

    def close(self) -> None:
        pass


class BarDisplay:
    """A bar redrawn in place on the terminal; log lines are printed above it."""

    def __init__(self, unit: str, stream=None):
        self.unit = unit
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self._shown = False
        self._lock = threading.Lock()
        self._handlers = [h for h in logging.getLogger().handlers + log.handlers
                          if type(h) is logging.StreamHandler]  # not FileHandler
        for h in self._handlers:
            h.addFilter(self._clear_before_log)

    def _clear_before_log(self, record) -> bool:
        self.clear()
        return True

    def clear(self) -> None:
        with self._lock:
            if self._shown:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
                self._shown = False

    def update(self, state: ProgressState, final: bool = False) -> None:
        width = shutil.get_terminal_size((100, 20)).columns
        if state.step or state.total:
            text = bar_line(state, self.unit, width)
        else:
            text = f"waiting for the workers to start ({clock(time.monotonic() - self.started)})"
        with self._lock:
            self.stream.write("\r\x1b[K" + text + ("\n" if final else ""))
            self.stream.flush()
            self._shown = not final

    def close(self) -> None:
        self.clear()
        for h in self._handlers:
            h.removeFilter(self._clear_before_log)


class NoDisplay:
    def update(self, state: ProgressState, final: bool = False) -> None:
        pass

    def close(self) -> None:
        pass


def make_display(mode: str, unit: str, every_s: float):
    if mode == "auto":
        mode = "bar" if sys.stdout.isatty() and sys.stderr.isatty() else "lines"
    if mode == "bar":
        return BarDisplay(unit)
    if mode == "lines":
        return LinesDisplay(unit, every_s)
    return NoDisplay()


class ProgressWatcher:
    """Polls the recorder in a thread while the run goes; prints notices and progress."""

    def __init__(self, poll: Callable[[int], ProgressState], display, poll_s: float = POLL_S):
        self.poll, self.display, self.poll_s = poll, display, poll_s
        self._cursor = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def __enter__(self) -> ProgressWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.tick(final=True)  # the last notices and the final count
        self.display.close()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.tick()

    def tick(self, final: bool = False) -> None:
        try:
            state = self.poll(self._cursor)
        except Exception as exc:  # progress must never break a run (Ray going down, say)
            log.debug("progress poll failed: %s", exc)
            return
        self._cursor = state.cursor
        for level, message in state.notices:
            log.log(logging.getLevelName(level), message)
        self.display.update(state, final=final)
