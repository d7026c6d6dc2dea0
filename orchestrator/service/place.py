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
import struct
import sys
from pathlib import Path

from orchestrator.private_dir import private_dir, user_base

SERVICE_DIR = "ORCHESTRATOR_SERVICE_DIR"  # where the socket and the log live (tests: their own)
# cluster.keep_alive's largest value: the service waits that long for its next command, and
# Python's waits overflow far below float's range (1e12 s, inf).
KEEP_ALIVE_MAX_S = 30 * 24 * 3600
PACKAGE = Path(__file__).resolve().parent.parent


class ForeignListener(OSError):
    """The service's socket is held by a process of another user: nothing was sent to it."""


def service_dir() -> Path:
    """This user's folder for services (``$ORCHESTRATOR_SERVICE_DIR``, else the user's private
    base): checked to be this user's alone, never through a link, since the commands it
    receives carry their environment (credentials included). NotPrivateError (one line)
    otherwise."""
    given = os.environ.get(SERVICE_DIR)
    if not given:
        return user_base()
    # Absolute: the service leaves its starting folder once it listens.
    return private_dir(Path(os.path.abspath(given)), variable=SERVICE_DIR)


def service_name() -> str:
    """One service per Python and orchestrator installation."""
    return hashlib.sha256(f"{sys.executable}\0{PACKAGE}".encode()).hexdigest()[:12]


def socket_path(folder: Path | None = None) -> Path:
    return (folder or service_dir()) / f"service-{service_name()}.sock"


def log_path(folder: Path | None = None) -> Path:
    return (folder or service_dir()) / f"service-{service_name()}.log"


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket, as the kernel saw it at its
    connect (a client's) or its listen (a listener's)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def connect(path: Path) -> socket.socket | None:
    """A connection to the service listening at ``path``, made only once its listener is known
    to run as this user (ForeignListener otherwise, before anything is sent: a request carries
    the command's whole environment). None where no service listens there, or where the path
    is not a socket (a link is never followed)."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return None
    except OSError:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
        uid = peer_uid(conn)
    except OSError:
        conn.close()
        return None
    if uid != os.getuid():
        conn.close()
        raise ForeignListener(f"the service's socket {path} is held by uid {uid}, not by this "
                              f"user; remove it, or set {SERVICE_DIR} to a folder of your own")
    return conn


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
