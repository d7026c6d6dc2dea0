"""A run's MLflow run, kept up to date from the driver by one thread.

The driver hands the tracker what the run recorder saw (metric values by step, the newest
checkpoint); the thread opens the MLflow run (or continues the one this run's checkpoints
name: a resumed run is one line across restarts) and sends batches. Training never waits on
it: a server that stops answering mid-run gets a warning, the values wait in a bounded buffer
(tracking.buffer) and go once it answers again; at the end the run waits at most
tracking.flush_s for what is left.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

from orchestrator.errors import one_line
from orchestrator.tracking.points import PointBuffer, Value
from orchestrator.tracking.uri import run_page, shown

log = logging.getLogger("orchestrator")

SEND_EVERY_S = 1.0
BATCH = 1000  # MLflow's most metrics in one log_batch
RETRY_S = (1.0, 2.0, 4.0, 8.0)  # then every 8 s
STATUSES = {"succeeded": "FINISHED", "already_finished": "FINISHED", "failed": "FAILED",
            "interrupted": "KILLED", "stopped": "KILLED"}


@dataclass
class TrackedRun:
    """What the tracker is told of the run (params and tags redacted already)."""

    uri: str
    experiment: str
    run_name: str
    params: dict[str, str]
    tags: dict[str, str]
    buffer: int = 100_000
    flush_s: float = 30.0
    store: object | None = None  # the run's CheckpointStore: where RUN_FILE is kept
    artifacts: list[str] = field(default_factory=list)  # files logged at the end


def quick_failures() -> None:
    """MLflow's client retries a request for minutes by default; the tracker retries itself
    (and keeps the values meanwhile). Only where the user set nothing, in this process."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    # Its "View run at" lines on stdout: the run's own line says where it is.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


class MlflowTracker:
    def __init__(self, run: TrackedRun):
        self.run = run
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.resumed = False
        self.buffer = PointBuffer(run.buffer)
        self._tags: dict[str, str] = {}
        self._lock = threading.Lock()
        self._go, self._opened = threading.Event(), threading.Event()
        self._ending, self._cancelled, self._done = (threading.Event(), threading.Event(),
                                                     threading.Event())
        self._status = "FAILED"
        self._error: str | None = None  # why the server did not take the last request
        self._away_since: float | None = None
        self._told_dropped = False
        self._client = None
        quick_failures()
        self._thread = threading.Thread(target=self._main, name="mlflow", daemon=True)
        self._thread.start()  # MLflow's import (~2 s) while Ray starts

    # --- the driver's side ---------------------------------------------------------------

    def begin(self) -> None:
        """Open (or continue) the MLflow run: once the command's checks passed."""
        self._go.set()

    def opened(self, timeout: float) -> str | None:
        """Wait for the MLflow run; None once open, else why not yet."""
        if not self._opened.wait(timeout):
            return f"no answer within {timeout:.0f} s"
        return None if self.run_id else self._error

    def add(self, points: list) -> None:
        """The recorder's points since the last call: (step, time, {tag: value}, {run tag:
        text})."""
        dropped = 0
        for step, at, values, tags in points:
            dropped += self.buffer.add(step, values, at)
            if tags:
                with self._lock:
                    self._tags.update(tags)
        if dropped and not self._told_dropped:
            self._told_dropped = True
            log.warning("MLflow: more than tracking.buffer=%d values waiting for %s: the "
                        "oldest are dropped", self.run.buffer, shown(self.run.uri))

    def finish(self, status: str, artifacts: list[str] = ()) -> bool:
        """Send what is left, the artifacts and the run's status, waiting at most
        tracking.flush_s; True if the server took it all."""
        self._status = STATUSES.get(status, "FAILED")
        self.run.artifacts = [a for a in artifacts if a and os.path.exists(a)]
        self._ending.set()
        self._go.set()
        if self._done.wait(self.run.flush_s):
            return self._error is None
        self._cancelled.set()
        log.warning("MLflow: %d metric values and the run's end were not sent to %s within "
                    "tracking.flush_s=%g s (%s)", len(self.buffer), shown(self.run.uri),
                    self.run.flush_s, self._error or "still sending")
        return False

    def where(self) -> str:
        return run_page(self.run.uri, self.experiment_id, self.run_id)

    def cancel(self) -> None:
        """The command ends before training (bad input found after the start)."""
        self._cancelled.set()
        self._go.set()

    # --- the thread ----------------------------------------------------------------------

    def _main(self) -> None:
        try:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.run.uri)
            self._go.wait()
            tries = 0
            while not self._cancelled.is_set():
                try:
                    if self._cycle():
                        return
                    tries = 0
                except Exception as exc:  # away, refusing, or MLflow's own error: said once
                    self._away(exc)
                    self._cancelled.wait(RETRY_S[min(tries, len(RETRY_S) - 1)])
                    tries += 1
        except Exception as exc:  # MLflow itself failed to import or start
            self._error = one_line(exc)[:300]
        finally:
            self._opened.set()
            self._done.set()

    def _cycle(self) -> bool:
        """Open the run if not yet, send one batch; True once the run has ended."""
        if self.run_id is None:
            self._open()
        ending = self._ending.is_set()
        sent = self._send()
        self._back()
        if ending and sent < BATCH:
            self._end()
            return True
        if sent < BATCH:
            self._ending.wait(SEND_EVERY_S)
        return False

    def _open(self) -> None:
        from orchestrator.tracking.mlflow_open import open_run

        self.run_id, self.experiment_id, self.resumed, last_steps = open_run(self._client,
                                                                             self.run)
        self.buffer.forget_up_to(last_steps)
        self._error = None
        self._opened.set()

    def _send(self) -> int:
        from mlflow.entities import Metric, RunTag

        values: list[Value] = self.buffer.peek(BATCH)
        with self._lock:
            tags, self._tags = self._tags, {}
        try:
            if values or tags:
                self._client.log_batch(
                    self.run_id, metrics=[Metric(v.key, v.value, v.at_ms, v.step) for v in values],
                    tags=[RunTag(k, str(v)) for k, v in tags.items()])
        except BaseException:
            with self._lock:
                self._tags = {**tags, **self._tags}
            raise
        self.buffer.taken(values)
        return len(values)

    def _end(self) -> None:
        for path in self.run.artifacts:
            self._client.log_artifact(self.run_id, path)
        self._client.set_terminated(self.run_id, self._status)

    def _away(self, exc: BaseException) -> None:
        reason = shown(one_line(exc))[:300]
        if self._error is None:
            log.warning("MLflow at %s did not take a request (%s): training goes on; the run's "
                        "metrics wait here (at most tracking.buffer=%d values) and go once it "
                        "answers", shown(self.run.uri), reason, self.run.buffer)
            self._away_since = time.monotonic()
        self._error = reason
        if self.run_id is None:
            self._opened.set()  # the driver decides what a failed start means

    def _back(self) -> None:
        if self._away_since is not None:
            log.info("MLflow at %s answers again after %.0f s: the waiting values are sent",
                     shown(self.run.uri), time.monotonic() - self._away_since)
            self._away_since = None
        self._error = None
