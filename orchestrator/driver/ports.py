"""Ports an embedded Ray's servers take on a machine shared with other commands and users.

A port checked free is not free a moment later: a command's dashboard starts seconds after its
port was chosen (once its workers have, ray_internals/head_start.py), and a second command
started beside it would choose the same one and find it taken then. So a chosen port is held,
bound but not listening, until its server starts: another command's choice, and Ray's own
check of a port (which binds with SO_REUSEADDR), see it taken and go elsewhere.
"""

from __future__ import annotations

import logging
import socket
import threading

log = logging.getLogger("orchestrator")


class PortHold:
    """``wanted`` on ``host`` if it is free, else one the kernel gives, held until release()."""

    def __init__(self, wanted: int, host: str = "127.0.0.1"):
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        for port in (wanted, 0):
            sock = socket.socket()  # no SO_REUSEADDR: a bind beside it fails, whoever tries
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                continue
            self._sock = sock
            break
        if self._sock is None:
            raise OSError(f"no free port on {host}")
        self.port = self._sock.getsockname()[1]
        if wanted and self.port != wanted:
            log.info("port %d on %s is taken; using %d", wanted, host, self.port)

    def release(self) -> None:
        """Let the port go, for the server about to bind it (again: nothing)."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

