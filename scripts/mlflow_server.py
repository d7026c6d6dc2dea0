"""A real MLflow tracking server on a free loopback port, for the tests and for trying
tracking=mlflow by hand:

    python scripts/mlflow_server.py DIR     # prints the tracking.uri to use, runs until Ctrl-C

A SQLite store and an artifact folder under DIR; artifacts go through the server (as with a
remote one). One request worker and no job runner: the server is one process group, which
the tests stop (and pause, SIGSTOP, to play a server gone away) by its id.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> MlflowServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        mlflow = Path(sys.executable).with_name("mlflow")
        log = open(self.data_dir / "server.log", "ab")
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.process = subprocess.Popen(
            [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.data_dir / 'm.db'}",
             "--artifacts-destination", str(self.data_dir / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server did not start: {self.data_dir / 'server.log'}")
            time.sleep(0.2)
        return self

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.uri + "/health", timeout=2):
                return True
        except (urllib.error.URLError, OSError):
            return False

    def pause(self) -> None:
        """The server gone away without closing anything (SIGSTOP to every process of it)."""
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGCONT)  # a paused one takes its SIGTERM
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        try:  # its request worker, if it outlived the server
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    server = MlflowServer(Path(sys.argv[1] if len(sys.argv) > 1 else "mlflow-data")).start()
    print(f"tracking=mlflow tracking.uri={server.uri}", flush=True)
    try:
        server.process.wait()
    except KeyboardInterrupt:
        server.stop()
