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
KINDS = (("RayTrainWorker", "train_worker"), ("torchrun_ddp.py", "train_worker"),
         ("TrainController", "controller"),
         ("RunRecorder", "recorder"), ("ray::IDLE", "idle_worker"),
         ("DashboardAgent", "ray_system"), ("RuntimeEnvAgent", "ray_system"),
         ("ray::", "other_actor"),
         ("raylet", "ray_system"), ("gcs_server", "ray_system"), ("dashboard", "ray_system"),
         ("log_monitor", "ray_system"), ("monitor.py", "ray_system"),
         ("runtime_env", "ray_system"), ("agent", "ray_system"))


def kind_of(cmdline: str, is_root: bool) -> str:
    if is_root:
        return "driver"
    return next((kind for needle, kind in KINDS if needle in cmdline), "other")


def title_of(command: str) -> str:
    """'ray::TrainController.run' -> 'ray::TrainController'; a Python process -> its script."""
    words = command.split()
    title = words[0].rpartition("/")[2]
    if title.startswith("python") and len(words) > 1:
        title = words[2] if words[1] in ("-m", "-u") and len(words) > 2 else words[1]
        title = title.rpartition("/")[2]
    return title.split(".")[0] if title.startswith("ray::") else title[:60]


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


TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / TICKS
    except (OSError, IndexError, ValueError):
        return 0.0


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
    """Polls a process and its descendants: per pid the peak RSS, the CPU seconds used (up to
    the last poll it was seen in) and what it is (the newest non-idle name wins: an idle Ray
    worker may become an actor). CPU seconds are what a loaded machine cannot blur: wall time
    there is mostly waiting for a core."""

    def __init__(self, root_pid: int, every_s: float = 0.5):
        self.root_pid = root_pid
        self.every_s = every_s
        self.peaks: dict[int, int] = {}
        self.kinds: dict[int, str] = {}
        self.cpu: dict[int, float] = {}
        self.titles: dict[int, str] = {}
        self.series: dict[int, list[tuple[float, float]]] = {}  # training workers: (time, cpu)
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
            used = cpu_s(pid)
            self.cpu[pid] = max(self.cpu.get(pid, 0.0), used)
            kind = kind_of(command, pid == self.root_pid)
            if kind != "idle_worker" or pid not in self.kinds:
                self.kinds[pid] = kind
                self.titles[pid] = title_of(command)
            if kind == "train_worker":
                self.series.setdefault(pid, []).append((time.time(), used))
        self.total_rss_peak_kb = max(self.total_rss_peak_kb, total)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        out = summarize_peaks(self.peaks, self.kinds, self.total_rss_peak_kb)
        out.update(summarize_cpu(self.cpu, self.kinds, self.titles))
        return out


def cpu_between(series: dict[int, list[tuple[float, float]]], start: float, end: float) -> float:
    """CPU seconds the processes used between two times, from their sampled (time, cpu)
    series, interpolated linearly between samples (flat outside them)."""
    def at(points: list[tuple[float, float]], t: float) -> float:
        if t <= points[0][0]:
            return points[0][1]
        for (t0, c0), (t1, c1) in zip(points, points[1:], strict=False):
            if t0 <= t <= t1:
                return c0 + (c1 - c0) * (t - t0) / max(t1 - t0, 1e-9)
        return points[-1][1]

    return round(sum(at(p, end) - at(p, start) for p in series.values() if p), 3)


def summarize_cpu(cpu: dict[int, float], kinds: dict[int, str], titles: dict[int, str]) -> dict:
    """CPU seconds in all, per kind of process and per process title (a Ray actor's class)."""
    by_kind: dict[str, float] = {}
    by_title: dict[str, float] = {}
    for pid, seconds in cpu.items():
        kind = kinds.get(pid, "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + seconds
        title = titles.get(pid, "?")
        by_title[title] = by_title.get(title, 0.0) + seconds
    return {"cpu_s": round(sum(cpu.values()), 2),
            "cpu_s_by_kind": {k: round(v, 2) for k, v in sorted(by_kind.items())},
            "cpu_s_by_title": {k: round(v, 2) for k, v in sorted(by_title.items())}}


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
