"""A node's folder where one rank posts each preemption check's answer for the node's other
ranks (orchestrator/ray_internals/preemption_agreement.py): the run's controller is then asked
once per node, not once per rank.

The folder is the user's own (private_dir.py: checked with lstat, this user's, no access for
group or others) under their private base, named for the worker group and the node's address:
only that group's ranks on that machine find it. The poster makes it as its worker starts,
before the group's first barrier, so a rank that finds no folder after that barrier shares no
disk with its node's poster (containers with one address and their own /tmp) and asks the
controller itself, as does a rank whose poster ended (removing the folder) before this rank's
last check. Each answer is a file written whole and renamed into place; the poster keeps the
last KEEP. It holds a lock on an owner file while it lives (worker/workdir.py), so a killed
group's folder is removed by the next poster that starts or ends on the node.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import time
from pathlib import Path
from typing import Any

from orchestrator.private_dir import NotPrivateError, private_dir, problem, user_base
from orchestrator.worker.workdir import lock_as_owner, remove_abandoned

PREFIX = "answers-"
# Answers kept: a reader more checks behind than this finds none, and asks the controller
# (preemption_agreement.py), which keeps as many and says so.
KEEP = 1024
FIRST_WAIT_S, LONGEST_WAIT_S = 0.0002, 0.005  # a reader's polls: the answer is usually there


class NotPosted(TimeoutError):
    """The answer of a check was not posted in time."""


class PosterGone(NotPosted):
    """The poster's folder is gone: its rank ended before this one's last check."""


def folder_of(group: str, node: str, base: Path | None = None) -> Path:
    return (base or user_base()) / f"{PREFIX}{group}-{re.sub(r'[^A-Za-z0-9.]', '_', node)}"


class Poster:
    """The node's poster: makes the folder (removing those of killed groups) and posts."""

    def __init__(self, group: str, node: str, base: Path | None = None):
        self.folder = folder_of(group, node, base)
        remove_abandoned(self.folder.parent, PREFIX)
        private_dir(self.folder)
        self._fd = lock_as_owner(self.folder)

    def post(self, check: int, answer: Any) -> None:
        # Whole, by a rename, but not fsynced (local_disk.write_atomically): an answer is read
        # within the second, and a power loss takes its readers with it.
        making = self.folder / f".{check}.new"
        with open(making, "wb") as out:
            out.write(pickle.dumps(answer))
        os.replace(making, self.folder / str(check))
        (self.folder / str(check - KEEP)).unlink(missing_ok=True)

    def close(self) -> None:
        if self._fd is None and not self.folder.exists():
            return
        shutil.rmtree(self.folder, ignore_errors=True)  # still locked while it goes
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        remove_abandoned(self.folder.parent, PREFIX)  # a killed group's, as workdir.py does


class Reader:
    """One of the node's other ranks: reads what the poster posts."""

    def __init__(self, group: str, node: str, base: Path | None = None):
        self.folder = folder_of(group, node, base)
        self._checked = False

    def shares_disk(self) -> bool:
        """Whether the poster's folder is here (asked after the group's first barrier), and
        this user's alone (else NotPrivateError)."""
        try:
            info = os.lstat(self.folder)
        except FileNotFoundError:
            return False
        why = problem(info)
        if why:
            raise NotPrivateError(f"{self.folder} is not this user's alone ({why})", not_ours=True)
        self._checked = True
        return True

    def read(self, check: int, wait_s: float) -> Any:
        """The answer of ``check``, waiting up to ``wait_s`` for it."""
        if not self._checked and not self.shares_disk():
            raise NotPosted(f"no poster's folder at {self.folder}")
        path, delay = os.path.join(self.folder, str(check)), FIRST_WAIT_S
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                if not os.path.lexists(self.folder):
                    raise PosterGone(f"{self.folder} was removed") from None
                if time.monotonic() > deadline:
                    raise NotPosted(f"check {check}'s answer was not posted within {wait_s:.0f} "
                                    f"s in {self.folder}") from None
                time.sleep(delay)
                delay = min(delay * 2, LONGEST_WAIT_S)
                continue
            with os.fdopen(fd, "rb") as answer:
                return pickle.loads(answer.read())
