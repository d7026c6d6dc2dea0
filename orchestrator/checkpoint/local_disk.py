"""A local store's side of the checkpoint protocol: durable writes, and reads that never
follow a link.

Durable: a checkpoint is committed by renaming its manifest into place, and retention then
deletes older ones. Without fsync a power loss can leave that manifest on disk while the
files it lists (or the folders naming them) are not, with the older checkpoints already gone.
So every stored file is fsync'ed once it is written, every folder that gained an entry once
its entries are in, and the commit's rename before the commit returns (and retention runs).

No links: a step folder is someone else's to write when the store is shared. A symbolic link
where a checkpoint's file or folder should be would hand over any file the user can read (or
a FIFO that blocks forever): every component under the store's root is opened with
O_NOFOLLOW, and only a plain file is read.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from orchestrator.checkpoint.manifest_checks import CorruptCheckpoint

CHUNK = 8 << 20  # bytes read, hashed and written at a time: memory stays flat for any file

_NO_FOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
# Filesystems that cannot fsync a folder (some FUSE and network ones) answer so: nothing to do.
_NO_FOLDER_FSYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


# -- durability ---------------------------------------------------------------------------
def fsync_file(path: str | Path) -> None:
    fd = os.open(path, _NO_FOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(path: str | Path) -> None:
    """Make the folder's entries (a rename into it, a file or folder made in it) durable; a
    folder not there has none to make so."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_FOLDER_FSYNC:
            raise
    finally:
        os.close(fd)


def folders_of(top: str, keys: Iterable[str]) -> list[str]:
    """Every folder under ``top`` holding one of ``keys`` (paths relative to it), deepest
    first, then ``top``, its parent and its grandparent (the step folder made under the run's
    root, itself perhaps made under the storage's)."""
    found = set()
    for key in keys:
        parts = key.split("/")[:-1]
        found.update("/".join([top, *parts[:depth]]) for depth in range(1, len(parts) + 1))
    above = [top, os.path.dirname(top), os.path.dirname(os.path.dirname(top))]
    return sorted(found, key=lambda p: -p.count("/")) + list(dict.fromkeys(above))


def store_file(local: Path, remote: Path, linked: bool) -> dict:
    """One file of a rank's snapshot into the store: moved (a rename on the same disk),
    copied where it cannot be (another disk, ``linked``: the user's own file reached through a
    link), hashed, and fsync'ed. Returns its {bytes, sha256}."""
    remote.parent.mkdir(parents=True, exist_ok=True)
    digest = sha256_of(local)
    try:
        if linked:
            raise OSError("a link: its content is copied")
        os.replace(local, remote)  # the staging folder is ours alone: move, not copy
    except OSError:  # another disk, or a link to a file that is not ours to move
        shutil.copyfile(local, remote)
    fsync_file(remote)  # once, whole: not a flush per chunk
    return {"bytes": os.path.getsize(remote), "sha256": digest}


def write_atomically(path: str, data: bytes) -> None:
    """``data`` under ``path`` whole or not at all, durable when this returns."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # the bytes before the name: never a named empty manifest
    os.replace(tmp, path)  # rename: readers see no file or a whole one
    fsync_folder(os.path.dirname(path))  # the rename itself


# -- reading without links ----------------------------------------------------------------
def open_plain(root: str, rel: str, where: str) -> int:
    """A descriptor of the plain file ``root/rel``, read-only. ``root`` (the store's root, from
    the config) may lie under links; no part of ``rel`` may be one (CorruptCheckpoint), nor
    anything but a folder on the way and a plain file at the end. A missing one raises
    FileNotFoundError."""
    parts = rel.split("/")
    folder = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            flags = _NO_FOLLOW | (os.O_NONBLOCK if last else os.O_DIRECTORY)  # a FIFO never waits
            try:
                fd = os.open(part, flags, dir_fd=folder)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise CorruptCheckpoint(f"{where}: {'/'.join(parts[:depth + 1])} "
                                        f"{what_is(folder, part)}") from None
            os.close(folder)
            folder = fd
        if not stat.S_ISREG(os.fstat(folder).st_mode):
            raise CorruptCheckpoint(f"{where}: {rel} is not a plain file")
        fd, folder = folder, -1
        return fd
    finally:
        if folder >= 0:
            os.close(folder)


def what_is(folder: int, name: str) -> str:
    """Why ``name`` in ``folder`` could not be opened as a checkpoint's folder or file."""
    try:
        if stat.S_ISLNK(os.lstat(name, dir_fd=folder).st_mode):
            return "is a symbolic link: a checkpoint's files are never read through one"
    except OSError:
        pass
    return "is not a folder, where the checkpoint's files need one"


def read_plain(root: str, rel: str, where: str, limit: int) -> bytes:
    """The whole content of a plain file (open_plain), refused unread when over ``limit``."""
    fd = open_plain(root, rel, where)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CorruptCheckpoint(f"{where}: {rel} holds {size} bytes, more than the "
                                    f"{limit} it may")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(size)
    finally:
        os.close(fd)


def link_checked(root: str, rel: str, entry: dict, target: Path, where: str) -> None:
    """One file of a local store, hard-linked to ``target`` and checked: size and SHA-256 of
    the very file linked (the same inode the check opened without following a link). On
    another disk a symbolic link, not a copy: every rank of every node would otherwise copy
    the whole checkpoint."""
    fd = open_plain(root, rel, where)
    try:
        opened = os.fstat(fd)
        if opened.st_size != entry["bytes"]:
            raise CorruptCheckpoint(f"{where} is missing or has the wrong size "
                                    f"({opened.st_size} bytes, {entry['bytes']} listed)")
        source = os.path.join(root, rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:  # the same file, kept even if the store later replaces it; never a link's target
            os.link(source, target, follow_symlinks=False)
        except OSError:
            target.symlink_to(os.path.realpath(source))
        linked = os.stat(target)
        if (linked.st_dev, linked.st_ino) != (opened.st_dev, opened.st_ino):
            raise CorruptCheckpoint(f"{where} was replaced while it was being linked")
        if sha256_of_fd(fd) != entry["sha256"]:
            raise CorruptCheckpoint(f"{where} does not match its manifest")
    finally:
        os.close(fd)


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return sha256_of_fd(f.fileno())


def sha256_of_fd(fd: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while block := os.pread(fd, CHUNK, offset):
        digest.update(block)
        offset += len(block)
    return digest.hexdigest()
