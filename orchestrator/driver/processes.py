"""The processes an embedded Ray leaves behind, found and stopped by pid (Linux's /proc).

ray.shutdown() stops the embedded cluster's GCS and raylet; the raylet's workers exit on their
own a moment later. A worker still running when the command exits keeps its port in Ray's
worker port range, which the next cluster on this machine hands out again (seen: a later driver
on another cluster judged dead a second after it connected, every run failing after it). So the
command tells them to end (SIGTERM), waits briefly, then kills what is left.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

Process = tuple[int, int]  # (pid, start time in clock ticks): a pid alone may be reused


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rindex(")") + 2:].split()  # the fields after "pid (comm)"


def descendants(root: int) -> list[Process]:
    """Every process below root by parent links (the session a process moved to does not
    matter); empty where /proc is not there."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _stat(int(entry.name))
        if fields is None:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        starts[int(entry.name)] = int(fields[19])
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append((pid, starts[pid]))
        todo.extend(children.get(pid, []))
    return found


PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans(adopt: bool = True) -> None:
    """Linux: a process of ours whose parent dies is re-parented to this one, not to init, so
    it stays among descendants() (a Ctrl-C during Ray's start: the raylet stopped while it was
    starting its agents, which then ran on, orphaned, after the command). False: no more."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(adopt), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def release_orphans(procs: list[Process], wait_s: float = 1.0) -> None:
    """The end of adopt_orphans, once procs are stopped: the adopted ones among them are
    reaped (an orphan that ends is this process's to wait for; unwaited, it stays a zombie,
    and whoever waits for its pid to go waits in vain), and no process is adopted any more:
    one started by a later command in this process (a daemon that leaves its parent on
    purpose) goes to init, as it would without us."""
    adopt_orphans(False)
    deadline = time.monotonic() + wait_s
    left = {pid for pid, _ in procs}
    while left:
        for pid in list(left):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not ours to wait for (Ray's own children), or gone
                left.discard(pid)
                continue
            if done:
                left.discard(pid)
        if not left or time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def running(proc: Process) -> bool:
    fields = _stat(proc[0])
    return fields is not None and int(fields[19]) == proc[1] and fields[0] != "Z"


def stop_leftovers(procs: list[Process], grace_s: float) -> list[Process]:
    """SIGTERM procs, wait up to grace_s for them to end, then SIGKILL the rest; return those
    killed. (Left to end on their own, the dashboard's module processes and the workers took
    ~0.8 s after ray.shutdown(); told to, they end at once.)"""
    deadline = time.monotonic() + grace_s
    left = [p for p in procs if running(p)]
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if running(p)]
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def kill_descendants(rounds: int = 50, spare: set[Process] = frozenset()) -> None:
    """Kill every process below this one but ``spare`` (those that were there before), for a
    command that exits before it used them, or a Ray whose start failed.
    Each is stopped first (SIGSTOP), again until no new one appears: a stopped process starts
    no other, and none is orphaned out of the tree (a raylet killed first left the dashboard
    agent it was starting, reparented, running). Then all of them get SIGKILL."""
    stopped: set[Process] = set()
    for _ in range(rounds):
        found = [p for p in descendants(os.getpid())
                 if p not in stopped and p not in spare and running(p)]
        if not found:
            break
        for proc in found:
            _signal(proc[0], signal.SIGSTOP)
            stopped.add(proc)
    for pid, _ in stopped:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def socket_folders(procs: list[Process]) -> set[Path]:
    """The multiprocessing folders (``pymp-*`` in the temporary folder) of the sockets procs
    hold: the dashboard's forkserver listens in one, which the dashboard would remove only at
    an exit of its own, never when it is stopped. Empty where /proc is not there."""
    inodes = set()
    for pid, _ in procs:
        try:
            links = [os.readlink(fd.path) for fd in os.scandir(f"/proc/{pid}/fd")]
        except OSError:  # gone, or not ours to read
            continue
        inodes.update(link[len("socket:["):-1] for link in links if link.startswith("socket:["))
    try:
        table = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return set()
    temp = Path(tempfile.gettempdir())
    folders = set()
    for fields in (line.split() for line in table):  # ... Inode Path
        if len(fields) >= 8 and fields[6] in inodes:
            folder = Path(fields[7]).parent
            if folder.parent == temp and folder.name.startswith("pymp-"):
                folders.add(folder)
    return folders
