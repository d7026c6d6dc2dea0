"""The script's process on one worker: torchrun's environment, its output, how it ended."""

from __future__ import annotations

import collections
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from orchestrator.observe.tracebacks import ERROR_LINE  # an exception's last line
from trainers.script.command import is_python

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the worker that started it dies (a killed Ray
    worker must not leave its script training on)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class ScriptProcess:
    """One rank's script: started in its own process group, its lines collected."""

    TAIL = 20  # stderr lines kept for the error message

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, rank: int,
                 error_file: Path):
        if argv and is_python(argv[0]):
            argv = [sys.executable, *argv[1:]]  # the workers' interpreter, as torchrun does
        self.rank, self.error_file = rank, error_file
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=self.TAIL)
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True,
                                     preexec_fn=die_with_parent)
        self._pumps = [threading.Thread(target=self._pump, args=(stream, err), daemon=True)
                       for stream, err in ((self.proc.stdout, False), (self.proc.stderr, True))]
        for pump in self._pumps:
            pump.start()

    def _pump(self, stream, is_err: bool) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self._lock:
                self._lines.append(line)
                if is_err:
                    self.stderr_tail.append(line)
        stream.close()

    def take_lines(self) -> list[str]:
        with self._lock:
            lines, self._lines = self._lines, []
        return lines

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        for pump in self._pumps:  # every line read before the end is told
            pump.join(timeout=5)
        return code

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait(timeout=10)

    def failure(self, code: int) -> str:
        """One line: torch's error file (the script's @record), else the exit code or signal
        and the last error line of stderr (``ValueError: ...``). A script that exited on its
        own may have said why in any words (``sys.exit("no data")``): its last line then; a
        killed one's last line is whatever it printed before (a library's warning), not why."""
        recorded = error_file_message(self.error_file)
        how = f"killed by {signal_name(code)}" if code < 0 else f"exited with code {code}"
        if recorded:
            return f"rank {self.rank}'s script {how}: {recorded}"
        lines = [ln.strip() for ln in reversed(self.stderr_tail) if ln.strip()]
        tail = next((ln for ln in lines if ERROR_LINE.match(ln)), "")
        if not tail and code > 0 and lines:
            tail = lines[0]
        return f"rank {self.rank}'s script {how}" + (f": {tail[:300]}" if tail else "")


def error_file_message(path: Path) -> str | None:
    """torch.distributed.elastic's @record writes {"message": {"message": ...}}."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    if not isinstance(message, str) or not message.strip():
        return None
    return message.strip().splitlines()[-1][:300]
