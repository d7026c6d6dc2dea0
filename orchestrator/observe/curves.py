"""Training curves in TensorBoard's event format, written without any ML framework.

TensorBoard's protos are used directly: its EventFileWriter (and tensorboardX's
SummaryWriter) would import TensorFlow (torch) into the orchestrator. Its record writer is
not: importing it imports TensorBoard's summary plugins and TensorFlow stand-in (numpy, boto3,
fsspec), ~0.4 CPU-s in the recorder's process as every run starts, for a frame of two
CRC-32C checksums written here instead.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Mapping

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)  # Castagnoli's, reflected
        table.append(crc)
    return tuple(table)


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: a CRC-32C rotated right by 15 bits, plus a constant."""
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord: its length (uint64), that length's masked CRC, the data, the data's."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", masked_crc32c(length)) + data
            + struct.pack("<I", masked_crc32c(data)))


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
        self._file.write(record(event.SerializeToString()))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()
