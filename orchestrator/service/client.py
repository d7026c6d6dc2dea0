"""A command that hands itself to the service (cluster.keep_alive): its command line, folder,
environment, umask and terminal go to the service, which runs it; the command relays Ctrl-C
and exits with the run's exit code. A command the service does not take runs on its own, and
nothing is sent to a service whose folder or listener is not this user's.
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
    ForeignListener,
    Reader,
    code_stamp,
    connect,
    log_path,
    send,
    service_dir,
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
        folder = service_dir()
    except OSError as exc:  # NotPrivateError: one line saying why and what to do
        note(f"{exc}; this command runs on its own")
        return None
    try:
        cwd = os.getcwd()
    except OSError as exc:  # a folder removed under the command
        note(f"this command's folder cannot be read ({exc.strerror}); it runs on its own")
        return None
    request = {"argv": argv, "cwd": cwd, "env": dict(os.environ), "umask": current_umask(),
               "started_at": started_at, "stamp": code_stamp(), "keep_alive_s": keep_alive_s}
    path, log = socket_path(folder), log_path(folder)
    for _ in range(2):  # a service of other code ends, and a new one starts
        try:
            conn = connect(path) or start_service(path, log)
        except ForeignListener as exc:
            note(f"{exc}; this command runs on its own")
            return None
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
            return relay(conn, reader, log)
    note("the service did not take the command; it runs on its own")
    return None


def current_umask() -> int:
    """This command's umask, which the service applies to it (reading it means setting it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def relay(conn: socket.socket, reader: Reader, log: Path) -> int | None:
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
        print(f"error: the service ended during the command (its log: {log})",
              file=sys.stderr, flush=True)
        return 1
    if "declined" in reply:  # asks for another Ray: nothing of it ran
        note(f"{reply['declined']}; this command runs on its own")
        return None
    if "error" in reply:  # the service could not set the command up: nothing of it ran
        print(f"error: {reply['error']}", file=sys.stderr, flush=True)
        return 1
    return int(reply["exit"])


def start_service(path: Path, log: Path) -> socket.socket | None:
    """Start the service as a daemon, and connect once it listens. Not this command's child:
    whatever ends this command's process tree (a terminal's hangup, a CI job's cleanup, a
    benchmark's) must not end the service with it."""
    try:
        out = open_log(log)
    except OSError as exc:
        note(f"cannot open the service's log {log} ({exc.strerror}; a link there is never "
             "followed): remove what is there; this command runs on its own")
        return None
    try:
        pid = daemon([sys.executable, "-m", "orchestrator.service", "serve"],
                     {**os.environ, "RAY_ENABLE_AUTO_CONNECT": "0"}, out)
    finally:
        os.close(out)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        conn = connect(path)
        if conn is not None:
            return conn
        if not alive(pid):
            note(f"the service did not start (its log: {log}); this command runs on its own")
            return None
        time.sleep(0.05)
    note(f"the service did not listen within {START_TIMEOUT_S:.0f} s (its log: {log}); "
         "this command runs on its own")
    return None


def open_log(log: Path) -> int:
    """The service's log, to append to: a link planted at its path is refused (O_NOFOLLOW), and
    the descriptor reaches no process but the service (O_CLOEXEC; the daemon dups it)."""
    return os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                   0o600)


def daemon(argv: list[str], env: dict[str, str], out: int) -> int:
    """Run ``argv`` in a grandchild of its own session (the child exits at once, so init
    adopts it), its stdout and stderr on ``out``; its pid."""
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
    while time.monotonic() < deadline and os.path.lexists(path):
        time.sleep(0.1)
