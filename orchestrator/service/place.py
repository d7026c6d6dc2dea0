"""Where a service listens, how a command and a service talk, and which code a service runs.

Light on imports: a command that hands itself to a service imports nothing else.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import socket
import stat
import sys
import tempfile
from pathlib import Path

SERVICE_DIR = "ORCHESTRATOR_SERVICE_DIR"  # where the socket and the log live (tests: their own)
# cluster.keep_alive's largest value: the service waits that long for its next command, and
# Python's waits overflow far below float's range (1e12 s, inf).
KEEP_ALIVE_MAX_S = 30 * 24 * 3600
PACKAGE = Path(__file__).resolve().parent.parent


class ServiceError(Exception):
    """The service's folder cannot be trusted, or the service ended unexpectedly."""


def service_dir() -> Path:
    """This user's folder for services: readable and writable by this user only, since the
    commands it receives carry their environment (credentials included)."""
    folder = Path(os.environ.get(SERVICE_DIR) or
                  Path(tempfile.gettempdir()) / f"orchestrator-{os.getuid()}")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise ServiceError(f"{folder} is not this user's alone (uid {info.st_uid}, mode "
                           f"{stat.S_IMODE(info.st_mode):o}); set {SERVICE_DIR} to a folder "
                           "of your own")
    return folder


def service_name() -> str:
    """One service per Python and orchestrator installation."""
    return hashlib.sha256(f"{sys.executable}\0{PACKAGE}".encode()).hexdigest()[:12]


def socket_path() -> Path:
    return service_dir() / f"service-{service_name()}.sock"


def log_path() -> Path:
    return service_dir() / f"service-{service_name()}.log"


def code_stamp() -> str:
    """The code as the service loaded it (the orchestrator, its trainers, its Hydra plugins): a
    service whose code has changed since (an upgrade, an edit) is replaced, not used."""
    newest = 0
    for package in (PACKAGE, PACKAGE.parent / "trainers", PACKAGE.parent / "hydra_plugins"):
        for entry in package.rglob("*.py"):
            try:
                newest = max(newest, entry.stat().st_mtime_ns)
            except OSError:  # an editor's lock file (.#cli.py), a link to nothing
                continue
    return f"{newest}"


def send(conn: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    data = (json.dumps(message) + "\n").encode()
    if fds:
        conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        conn.sendall(data)


class Reader:
    """JSON lines from a socket, and the descriptors sent with them."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buffer = b""
        self.fds: list[int] = []

    def next(self) -> dict | None:
        """The next message; None at the end of the connection."""
        while b"\n" not in self.buffer:
            data, ancillary, _, _ = self.conn.recvmsg(65536, socket.CMSG_SPACE(3 * 4))
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                    self.fds.extend(fds)
            if not data:
                return None
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)
