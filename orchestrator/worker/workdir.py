"""A worker's own folder on its node's disk: an object store's staged snapshots and the copy of
the checkpoint it restored from, which can be as large as the checkpoint.

The worker removes it when it ends. A killed worker cannot: a restart tears down every worker
of the group, and a process killed by the kernel or a signal runs no cleanup, so each restart
would leave a checkpoint's copy behind on every node. The folders of dead workers are therefore
removed by the next worker that starts or ends on the node. A live worker holds a lock on a file
in its folder; the kernel drops the lock with the process however it died, so a folder whose lock
can be taken has no owner left. Locks, not process ids: nodes may share a /tmp across process
namespaces. The lock file names its host, and only this host's folders are removed: where
the temporary folder is shared between machines (a TMPDIR on a network filesystem), a lock
may be seen by its own machine only. Where the filesystem has no locks at all, a folder gets
no lock file and is never removed by another worker (as before).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "orchestrator-rank"
OWNER = ".owner"  # locked by the live worker, naming its host; shows only once locked


NO_LOCKS = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL)


class Workdir:
    """A new folder under ``root`` (the node's temporary folder) for the worker of ``rank``,
    after removing those whose workers died."""

    def __init__(self, rank: int, root: Path | str | None = None):
        self.root = Path(root or tempfile.gettempdir())
        remove_abandoned(self.root, PREFIX)
        self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{rank}-", dir=self.root))
        self._fd = lock_as_owner(self.path)
        self._removed = False

    def remove(self) -> None:
        """Remove the folder (still locked while it goes), then those of dead workers."""
        if self._removed:
            return
        self._removed = True
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        remove_abandoned(self.root, PREFIX)


def lock_as_owner(folder: Path) -> int | None:
    """Lock ``folder``'s owner file for as long as this process lives; its descriptor, or None
    where the filesystem has no locks (the folder is then kept out of every sweep)."""
    making = folder / f"{OWNER}.new"
    fd = os.open(making, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in NO_LOCKS:
            raise
        log.info("no lock on %s (%s): a killed worker's folder stays there", folder, exc)
        return None
    os.write(fd, socket.gethostname().encode())
    os.rename(making, folder / OWNER)  # a sweep sees the file only once it is locked
    return fd


def remove_abandoned(root: Path, prefix: str = PREFIX) -> list[Path]:
    """Remove this user's folders under ``root`` whose names begin with ``prefix`` and whose
    owner is gone; return them."""
    host = socket.gethostname()
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(prefix)]
    except OSError:
        return []
    removed = [Path(entry.path) for entry in entries if remove_if_abandoned(entry, host)]
    if removed:
        log.info("removed %d folders of workers that were killed: %s", len(removed),
                 ", ".join(p.name for p in removed))
    return removed


def remove_if_abandoned(entry: os.DirEntry, host: str) -> bool:
    try:
        if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid():
            return False
        fd = os.open(os.path.join(entry.path, OWNER), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # gone, being made, made where there are no locks, or not ours
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.read(fd, 256).decode(errors="replace") != host:
            return False  # another machine's: its lock may not show here
        shutil.rmtree(entry.path, ignore_errors=True)  # held while it goes: removed once
        return True
    except OSError:  # its worker is alive
        return False
    finally:
        os.close(fd)
