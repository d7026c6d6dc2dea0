"""Folders of this user's alone, outside a run's own folders (the service's socket and log, a
script run's working folders): on a machine shared with other users, a folder someone else
made first, or a link planted where ours will be, must never be used.

Every check is made with ``lstat`` (a link is refused, never followed): the folder must be a
real directory, owned by this user, with no access for group or others. The base of them all is
``orchestrator-<uid>`` in the temporary folder; ``ORCHESTRATOR_PRIVATE_DIR`` moves it.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

BASE_VARIABLE = "ORCHESTRATOR_PRIVATE_DIR"


class NotPrivateError(OSError):
    """A folder that is not this user's alone; the message is one line saying why and what to
    do. ``not_ours``: someone else's, a link, or open to others: a worker's restart meets the
    same folder, so it is not retried."""

    def __init__(self, message: str, not_ours: bool = False):
        super().__init__(message)
        if not_ours:  # else as its kind says (a subclass may never retry)
            self.retry = False


def user_base() -> Path:
    """This user's private base folder, made (0700) and checked."""
    return private_dir(base_path(), variable=BASE_VARIABLE)


def base_path() -> Path:
    given = os.environ.get(BASE_VARIABLE)
    return Path(given) if given else Path(tempfile.gettempdir()) / f"orchestrator-{os.getuid()}"


def private_dir(path: Path, variable: str = BASE_VARIABLE) -> Path:
    """``path`` made if missing (mode 0700, its parent must exist), then checked: a directory,
    not a link, this user's, no group or other access. ``variable`` is named in the error as
    the way to choose another folder."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise NotPrivateError(f"cannot make {path} ({exc.strerror}); set {variable} to a "
                              "folder of your own") from None
    check_private(path, variable)
    return path


def check_private(path: Path, variable: str = BASE_VARIABLE) -> None:
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise NotPrivateError(f"cannot read {path} ({exc.strerror}); set {variable} to a "
                              "folder of your own") from None
    why = problem(info)
    if why:
        raise NotPrivateError(f"{path} is not this user's alone ({why}); set {variable} to a "
                              "folder of your own", not_ours=True)


def problem(info: os.stat_result) -> str | None:
    """Why a folder with this ``lstat`` is not private to this user, or None."""
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory"
    if info.st_uid != os.getuid():
        return f"owned by uid {info.st_uid}"
    if stat.S_IMODE(info.st_mode) & 0o077:
        return f"mode {stat.S_IMODE(info.st_mode):o}, open to group or others"
    return None


def unique_dir(parent: Path, prefix: str) -> Path:
    """A new folder of this user's alone under ``parent`` (itself private), never one that was
    there before: two runs never share one."""
    check_private(parent)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


PROCESS_DIRS = "processes"  # in the base: folders of one process each (process_dir)


def process_dir(kind: str) -> Path:
    """A new private folder of this process's, ``processes/<kind>-<pid>-<random>`` in the
    user's base: the process removes it at its end; one that a SIGKILL left is removed by the
    next call here, or remove_dead_dirs, once its process is gone."""
    remove_dead_dirs()
    return unique_dir(private_dir(user_base() / PROCESS_DIRS), f"{kind}-{os.getpid()}-")


def remove_dead_dirs() -> None:
    """Remove the process folders (process_dir) whose process is gone; makes nothing."""
    base = base_path()
    try:
        if problem(os.lstat(base)) or problem(os.lstat(base / PROCESS_DIRS)):
            return
        entries = list(os.scandir(base / PROCESS_DIRS))
    except OSError:
        return
    for entry in entries:
        found = re.fullmatch(r"\w+?-(\d+)-\w+", entry.name)
        if found and not alive(int(found[1])) and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)


def alive(pid: int) -> bool:
    """Whether a process ``pid`` runs (a zombie, killed and not yet waited for, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # field 3 of /proc/<pid>/stat, after "pid (comm)": its state
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return text[text.rindex(")") + 2:].split()[0] != "Z"
