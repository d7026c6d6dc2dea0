"""What data a run trains on, by content: the SHA-256 of every file of data.path and
data.eval_path, computed on the driver and kept in every checkpoint's meta (``data_files``), so
that a resume over data that changed since is found whatever changed (rows rewritten at the
same size, every label flipped) and whatever did not (a copy with new modification times is
the same data).

A file is read whole once per version: its digest is cached in this user's private folder
under its path, size, modification time (and, on a local disk, inode and change time), as
DVC and make decide that a file is unchanged; a rerun over the same files reads nothing. A file
modified in the last 2 s is hashed but not cached (an object store's times have whole seconds:
a rewrite of the same size within one would look unchanged).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pyarrow.fs as pafs

from orchestrator.errors import ConfigError, one_line
from orchestrator.storage.location import StorageSpec

CHUNK = 4 * 2**20
META_KEY = "data_files"  # in a checkpoint's meta: {file: sha256}


def data_fingerprint(spec: StorageSpec, infos: list[pafs.FileInfo], key: str) -> dict[str, str]:
    """{file: sha256 of its bytes} of ``infos`` (listed in ``spec``'s filesystem), ``key``
    named where one cannot be read."""
    fs, _ = spec.filesystem()
    local = isinstance(fs, pafs.LocalFileSystem)
    cache = cache_dir()
    found = {}
    for info in infos:
        identity = file_identity(spec, info, local)
        cached = cache / hashlib.sha256(identity.encode()).hexdigest()[:40] if cache else None
        digest = read_cached(cached)
        if digest is None:
            try:
                digest = content_digest(fs, info.path)
            except OSError as exc:
                raise ConfigError(f"{key}: {info.path} cannot be read "
                                  f"({one_line(exc)[:200]})") from None
            if not racy(info):
                write_cached(cached, digest)
        found[info.path] = digest
    return found


RACY_NS = 2 * 10**9  # an object store's modification time has whole seconds


def racy(info: pafs.FileInfo) -> bool:
    """Whether the file may still be rewritten within its modification time's resolution (as
    git's "racily clean" entries): its digest is not cached, or a rewrite of the same size in
    the same second would keep the old one."""
    return info.mtime_ns is None or time.time_ns() - info.mtime_ns < RACY_NS


def file_identity(spec: StorageSpec, info: pafs.FileInfo, local: bool) -> str:
    """What says a file is the version whose digest was cached: a rewrite changes it."""
    fields = [spec.endpoint or "", info.path, info.size, info.mtime_ns]
    if local:  # a rewrite keeping the modification time (cp -p, touch -r) changes ctime
        try:
            st = os.stat(info.path)
            fields += [st.st_dev, st.st_ino, st.st_ctime_ns]
        except OSError:
            fields.append("?")
    return json.dumps(fields, default=str)


def content_digest(fs: pafs.FileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open_input_stream(path) as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def cache_dir() -> Path | None:
    """This user's cache of digests; None where there is no private folder (nothing cached)."""
    from orchestrator.private_dir import NotPrivateError, private_dir, user_base

    try:
        return private_dir(user_base() / "data-digests")
    except NotPrivateError:
        return None


def read_cached(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        value = path.read_text().strip()
    except OSError:
        return None
    return value if len(value) == 64 and all(c in "0123456789abcdef" for c in value) else None


def write_cached(path: Path | None, digest: str) -> None:
    if path is None:
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(digest)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a cache that cannot be written: hashed again next time


def what_changed(before: dict[str, str], now: dict[str, str]) -> str | None:
    """One phrase naming the files added, removed or rewritten since ``before``; None if the
    content is the same."""
    added, removed = sorted(set(now) - set(before)), sorted(set(before) - set(now))
    changed = sorted(p for p in set(before) & set(now) if before[p] != now[p])
    parts = []
    for word, paths in (("rewritten", changed), ("added", added), ("removed", removed)):
        if paths:
            more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
            parts.append(f"{len(paths)} file{'s' if len(paths) > 1 else ''} {word} "
                         f"({paths[0]}{more})")
    return ", ".join(parts) or None


def fingerprint_problem(value: object) -> str | None:
    """What is wrong with a checkpoint's ``data_files``, or None (orchestrator/checkpoint/
    manifest_checks.py: a crafted or broken manifest is refused as corrupt)."""
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in value.items()):
        return "is not a map of file names to SHA-256 digests"
    return None
