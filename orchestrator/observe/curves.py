"""Training curves in TensorBoard's event format, written without any ML framework.

TensorBoard's own record writer and protos are used directly: its EventFileWriter (and
tensorboardX's SummaryWriter) would import TensorFlow (torch) into the orchestrator.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.record_writer import RecordWriter


class Curves:
    """Scalars by global step, one curve per tag across restarts and resizes.

    A worker group restarted from a checkpoint computes some steps again; those steps are
    already on the curve, so a tag's steps only ever go up (one point per step).
    """

    def __init__(self, logdir: str):
        os.makedirs(logdir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        self.path = os.path.join(logdir, name)
        self._file = open(self.path, "wb")
        self._writer = RecordWriter(self._file)
        self._last_step: dict[str, int] = {}
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()

    def add(self, step: int, values: Mapping[str, float], at: float | None = None) -> None:
        fresh = [Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()
                 if v is not None and step > self._last_step.get(tag, -1)]
        if not fresh:
            return
        for value in fresh:
            self._last_step[value.tag] = step
        self._write(Event(wall_time=at or time.time(), step=step, summary=Summary(value=fresh)))

    def _write(self, event: Event) -> None:
        self._writer.write(event.SerializeToString())

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._writer.flush()
            self._file.close()
