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


class Workdir:
    """A new folder under ``root`` (the node's temporary folder) for the worker of ``rank``,
    after removing those whose workers died."""

    def __init__(self, rank: int, root: Path | str | None = None):
        self.root = Path(root or tempfile.gettempdir())
        remove_abandoned(self.root)
        self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{rank}-", dir=self.root))
        making = self.path / f"{OWNER}.new"
        self._fd = os.open(making, os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:  # a filesystem without locks: kept out of every sweep
            if exc.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL):
                raise
            log.info("no lock on %s (%s): a killed worker's folder stays there", self.path, exc)
            return
        os.write(self._fd, socket.gethostname().encode())
        os.rename(making, self.path / OWNER)

    def remove(self) -> None:
        """Remove the folder (still locked while it goes), then those of dead workers."""
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = None
        remove_abandoned(self.root)


def remove_abandoned(root: Path) -> list[Path]:
    """Remove this user's worker folders under ``root`` whose owner is gone; return them."""
    removed, host = [], socket.gethostname()
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(PREFIX)]
    except OSError:
        return removed
    for entry in entries:
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(entry.path, OWNER), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # gone, being made, or not ours
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.read(fd, 256).decode(errors="replace") != host:
                continue  # another machine's: its lock may not show here
        except OSError:  # its worker is alive
            continue
        else:  # held while it goes: no other worker removes it at the same time
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d folders of workers that were killed: %s", len(removed),
                 ", ".join(p.name for p in removed))
    return removed
