"""A started command's process tree (an embedded Ray's processes are the driver's descendants):
its peak resident memory per process, and stopping it by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

# Ray names its worker processes after what they run (setproctitle): "ray::RayTrainWorker...".
KINDS = (("RayTrainWorker", "train_worker"), ("TrainController", "controller"),
         ("RunRecorder", "recorder"), ("ray::IDLE", "idle_worker"), ("ray::", "other_actor"),
         ("raylet", "ray_system"), ("gcs_server", "ray_system"), ("dashboard", "ray_system"),
         ("log_monitor", "ray_system"), ("monitor.py", "ray_system"),
         ("runtime_env", "ray_system"), ("agent", "ray_system"))


def kind_of(cmdline: str, is_root: bool) -> str:
    if is_root:
        return "driver"
    return next((kind for needle, kind in KINDS if needle in cmdline), "other")


def parents() -> dict[int, int]:
    """pid -> parent pid of every process, from /proc (no psutil in the venv)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        out[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])  # the name may hold ")"
    return out


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, ppid in parents().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot): tells a reused pid apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def peak_kb(pid: int) -> tuple[int, int]:
    """(VmHWM, VmRSS) in kB: the peak and current resident set, from /proc."""
    hwm = rss = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    hwm = int(line.split()[1])
                elif line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return hwm, rss


class TreeWatcher:
    """Polls a process and its descendants: per pid the peak RSS and what it is (the newest
    non-idle name wins: an idle Ray worker may become an actor)."""

    def __init__(self, root_pid: int, every_s: float = 0.5):
        self.root_pid = root_pid
        self.every_s = every_s
        self.peaks: dict[int, int] = {}
        self.kinds: dict[int, str] = {}
        self.total_rss_peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> TreeWatcher:
        self._thread.start()
        return self

    def pids(self) -> list[int]:
        if not Path(f"/proc/{self.root_pid}").exists():
            return []
        return [self.root_pid, *descendants(self.root_pid)]

    def sample(self) -> None:
        total = 0
        for pid in self.pids():
            command = cmdline(pid)
            if not command:  # gone, or a zombie
                continue
            hwm, rss = peak_kb(pid)
            total += rss
            self.peaks[pid] = max(self.peaks.get(pid, 0), hwm)
            kind = kind_of(command, pid == self.root_pid)
            if kind != "idle_worker" or pid not in self.kinds:
                self.kinds[pid] = kind
        self.total_rss_peak_kb = max(self.total_rss_peak_kb, total)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return summarize_peaks(self.peaks, self.kinds, self.total_rss_peak_kb)


def summarize_peaks(peaks: dict[int, int], kinds: dict[int, str], total_kb: int) -> dict:
    """Peak RSS in MiB: the driver, each training worker, and the sum per kind of process."""
    mib = lambda kb: round(kb / 1024, 1)  # noqa: E731
    by_kind: dict[str, list[int]] = {}
    for pid, kb in peaks.items():
        by_kind.setdefault(kinds.get(pid, "other"), []).append(kb)
    return {
        "driver_mib": mib(max(by_kind.get("driver", [0]))),
        "train_workers_mib": sorted((mib(kb) for kb in by_kind.get("train_worker", [])),
                                    reverse=True),
        "sum_of_peaks_by_kind_mib": {k: mib(sum(v)) for k, v in sorted(by_kind.items())},
        "processes_by_kind": {k: len(v) for k, v in sorted(by_kind.items())},
        "tree_rss_peak_mib": mib(total_kb),
    }


def start(cmd: list[str], cwd, env: dict, log_path) -> subprocess.Popen:
    """Started in a session of its own, so that what it leaves behind can be found."""
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop_tree(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGINT (a run's Ctrl-C: it shuts its Ray down), then SIGKILL whatever of its tree is
    left, by pid."""
    left = [(pid, start_time(pid)) for pid in descendants(proc.pid)]
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    time.sleep(1.0)
    for pid, started in left:
        if started is not None and start_time(pid) == started:  # still that process
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
