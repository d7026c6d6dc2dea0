"""A command that hands itself to the service (cluster.keep_alive): its command line, folder,
environment and terminal go to the service, which runs it; the command relays Ctrl-C and
exits with the run's exit code. A command the service does not take runs on its own.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

from orchestrator.service.place import (
    KEEP_ALIVE_MAX_S,
    Reader,
    ServiceError,
    code_stamp,
    log_path,
    send,
    socket_path,
)

KEY = "cluster.keep_alive"
START_TIMEOUT_S = 120.0  # the service's own start: Python, Hydra, torch (not Ray: its first command)
NOT_A_RUN = ("-m", "--multirun", "-c", "--cfg", "--help", "-h", "--hydra-help", "--info", "-i",
             "--experimental-rerun", "--shell-completion", "-sc")


def keep_alive_asked(argv: list[str]) -> float | None:
    """cluster.keep_alive's seconds where the command line sets it above 0 and runs one job;
    else None (a bad value is left to the checks, which say what is allowed)."""
    if any(arg.split("=", 1)[0] in NOT_A_RUN for arg in argv):
        return None
    for arg in reversed(argv):
        key, _, value = arg.lstrip("+").partition("=")
        if key == KEY:
            try:
                seconds = float(value)
            except ValueError:
                return None
            return seconds if 0 < seconds <= KEEP_ALIVE_MAX_S else None
    return None


def note(text: str) -> None:
    print(f"{KEY}: {text}", file=sys.stderr, flush=True)


def hand_over(argv: list[str], started_at: float) -> int | None:
    """Run this command in the service: its exit code, or None where it must run on its own."""
    keep_alive_s = keep_alive_asked(argv)
    if keep_alive_s is None:
        return None
    try:
        path = socket_path()
    except ServiceError as exc:
        note(f"{exc}; this command runs on its own")
        return None
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ),
               "started_at": started_at, "stamp": code_stamp(), "keep_alive_s": keep_alive_s}
    for _ in range(2):  # a service of other code ends, and a new one starts
        conn = connect(path) or start_service(path)
        if conn is None:
            return None
        with conn:
            try:
                send(conn, request, [0, 1, 2])
                reader = Reader(conn)
                reply = reader.next()
            except OSError as exc:  # a standard stream closed, say: nothing ran yet
                note(f"the service could not take the command ({exc}); it runs on its own")
                return None
            if reply is None or "stale" in reply:
                wait_gone(path)
                continue
            if "declined" in reply:
                note(f"{reply['declined']}; this command runs on its own")
                return None
            return relay(conn, reader)
    note("the service did not take the command; it runs on its own")
    return None


def relay(conn: socket.socket, reader: Reader) -> int | None:
    """Ctrl-C (and SIGTERM, SIGHUP) to the service's run, until it sends the exit code."""
    def forward(signum, frame) -> None:
        try:
            send(conn, {"signal": signum})
        except OSError:
            pass

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    reply = reader.next()
    if reply is None:
        print(f"error: the service ended during the command (its log: {log_path()})",
              file=sys.stderr, flush=True)
        return 1
    if "declined" in reply:  # asks for another Ray: nothing of it ran
        note(f"{reply['declined']}; this command runs on its own")
        return None
    return int(reply["exit"])


def connect(path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
    except OSError:
        conn.close()
        return None
    return conn


def start_service(path) -> socket.socket | None:
    """Start the service as a daemon, and connect once it listens. Not this command's child:
    whatever ends this command's process tree (a terminal's hangup, a CI job's cleanup, a
    benchmark's) must not end the service with it."""
    pid = daemon([sys.executable, "-m", "orchestrator.service", "serve"],
                 {**os.environ, "RAY_ENABLE_AUTO_CONNECT": "0"}, log_path())
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        conn = connect(path)
        if conn is not None:
            return conn
        if not alive(pid):
            note(f"the service did not start (its log: {log_path()}); this command runs on its "
                 "own")
            return None
        time.sleep(0.05)
    note(f"the service did not listen within {START_TIMEOUT_S:.0f} s (its log: {log_path()}); "
         "this command runs on its own")
    return None


def daemon(argv: list[str], env: dict[str, str], log) -> int:
    """Run ``argv`` in a grandchild of its own session (the child exits at once, so init
    adopts it); its pid."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: a new session, the grandchild, then gone
        try:
            os.close(read)
            os.setsid()
            grandchild = os.fork()
            if grandchild == 0:
                os.close(write)
                null = os.open(os.devnull, os.O_RDONLY)
                out = os.open(str(log), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                os.dup2(null, 0)
                os.dup2(out, 1)
                os.dup2(out, 2)
                os.closerange(3, 1 << 16)
                os.execve(argv[0], argv, env)
            os.write(write, str(grandchild).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        pid = int(pipe.read() or 0)
    os.waitpid(child, 0)
    return pid


def alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive (init reaps it soon)
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(path, timeout_s: float = 60.0) -> None:
    """A stale service closes its socket, then shuts its Ray down."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and path.exists():
        time.sleep(0.1)
