"""Where the script runs on a node: a folder of this user's alone, new for every attempt.

On a machine shared with other users, a folder of a fixed name in the temporary folder is
whoever made it first: one planted there could swap the run's folder (and its train.py), read
the checkpoints put back into it, or have files moved into trainer.workdir. So the node's
folder is made with mkdtemp under ``user_base()/script`` (orchestrator/private_dir.py: mode
0700, this user's, checked with lstat); where that base is not this user's alone, the run
stops with one line saying so, and never uses it.

A killed worker leaves its folder behind (links, restored files, copies taken aside); the next
attempt on the node removes it, never a live one's. As for the workers' own folders
(orchestrator/worker/workdir.py): the node's local rank 0 holds a lock on a file in its folder
while it lives; the kernel drops the lock with the process however it died, so a folder whose
lock can be taken has no owner left. The lock file names its host, and only this host's
folders are removed (a temporary folder shared between machines shows a lock to its own
machine only). Where the filesystem has no locks, a folder gets no lock file and only its own
worker removes it.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from orchestrator.private_dir import (
    NotPrivateError,
    check_private,
    private_dir,
    unique_dir,
    user_base,
)
from orchestrator.worker.workdir import lock_as_owner, remove_abandoned

log = logging.getLogger(__name__)

SUBFOLDER = "script"  # under user_base(): every node folder of this user's script runs


class ScriptFolderNotPrivate(NotPrivateError):
    """The base of the script's folders is not this user's alone (NotPrivateError's line)."""

    retry = False  # every restart would meet the same folder: the run stops at once


def script_base() -> Path:
    """``user_base()/script``, made (0700) and checked."""
    try:
        return private_dir(user_base() / SUBFOLDER)
    except NotPrivateError as exc:
        raise ScriptFolderNotPrivate(str(exc)) from None


def folder_prefix(run_name: str, attempt: str, node_rank: int) -> str:
    """How the names of one attempt's folder on one node begin (mkdtemp adds the rest)."""
    return f"{run_name}-{attempt}-node{node_rank}-"


class NodeFolder:
    """A new folder for this node's part of one attempt, made by its local rank 0 and locked as
    long as that worker lives; the folders of killed attempts are removed first."""

    def __init__(self, base: Path, prefix: str):
        self.base = base
        remove_abandoned(base, "")
        self.path = unique_dir(base, prefix)
        self._fd = lock_as_owner(self.path)

    def remove(self) -> None:
        """Remove the folder (still locked while it goes), then those of killed attempts."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        remove_abandoned(self.base, "")


def node_folder_made(base: Path, prefix: str) -> Path:
    """The folder the node's local rank 0 made for this attempt, for the node's other ranks
    (after the barrier that follows its making): the only one whose name begins so."""
    found = sorted(base / name for name in os.listdir(base) if name.startswith(prefix))
    if len(found) != 1:
        raise RuntimeError(f"{len(found)} folders {base / prefix}* for this attempt on this "
                           "node: one was expected")
    check_private(found[0])
    return found[0]


