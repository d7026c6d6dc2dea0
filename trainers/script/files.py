"""A node's folder for the script, and the checkpoint files it writes there.

The script runs in a folder of its own on each node, made of links to everything in
trainer.workdir except the checkpoint files' folders, which are real and private: the
script finds its code and data where it always does, and the snapshot it writes belongs to
this run alone (two trials of a sweep never share one). Before it starts, the newest
committed checkpoint's files are copied back in; only committed ones, so a file torn by a kill
mid-write is never put back.

A written file is taken once it is *closed and still*: no process has it open (Linux's
/proc/<pid>/fd), and its size, mtime, ctime and inode are those a poll that found it closed
saw. Every copy out of the live folder is checked after it is made (copy_unchanged): the file
opened is still that version when the copy ends (fstat) and its path still names it, or the
copy is thrown away; a torn copy is never handed over.
The copy goes aside at once, so a script that overwrites snapshot.pt in place never tears the
one being uploaded.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import shutil
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.checkpoint.store import through_link
from orchestrator.data.manifest import glob_match

WORK = "work"  # the checkpoint files under the script's working directory
CKPT_DIR = "checkpoint_dir"  # the files under $CHECKPOINT_DIR

log = logging.getLogger(__name__)


class RewrittenDuringSave(RuntimeError):
    """A checkpoint file changed after it was taken: this checkpoint is not committed (the
    next one takes the new version once it is closed and still)."""


def private_tops(patterns: list[str]) -> list[str]:
    """The first component of each pattern: those entries are the run's own, not links."""
    return [Path(p).parts[0] for p in patterns]


def make_node_folder(root: Path, workdir: Path, patterns: list[str]) -> tuple[Path, Path]:
    """root/work: links to workdir's entries (except the checkpoint files' tops);
    root/checkpoint_dir: $CHECKPOINT_DIR. Returns (work, checkpoint_dir)."""
    work, ckpt = root / WORK, root / CKPT_DIR
    work.mkdir(parents=True, exist_ok=True)
    ckpt.mkdir(exist_ok=True)
    tops = private_tops(patterns)
    for entry in workdir.iterdir():
        if any(fnmatch.fnmatch(entry.name, top) for top in tops):
            continue
        link = work / entry.name
        if not link.exists() and not link.is_symlink():
            link.symlink_to(entry)
    for pattern in patterns:  # a folder named by a pattern (ckpt/*.pt, ckpt): private, empty
        parts = Path(pattern).parts
        top = parts[0]
        names_a_folder = len(parts) > 1 or pattern.endswith("/") or (workdir / top).is_dir()
        if names_a_folder and not any(c in top for c in "*?["):
            (work / top).mkdir(exist_ok=True)
    return work, ckpt


def outside_paths_absolute(argv: list[str], workdir: Path) -> list[str]:
    """The script runs in a folder of links, whose parent is not workdir's: a ``../data`` word
    (``--data=../data``) is made absolute against workdir, as it would have been read there."""
    out = []
    for word in argv:
        prefix, eq, value = word.partition("=") if word.startswith("-") else ("", "", word)
        if not eq:
            prefix, value = "", word
        if value == ".." or value.startswith("../"):
            word = prefix + eq + os.path.normpath(workdir / value)
        out.append(word)
    return out


def keep_new_entries(work: Path, workdir: Path, patterns: list[str]) -> list[str]:
    """What the script made in its folder (results.json, a plot, a runs/ folder) goes to
    trainer.workdir when it ends, as under torchrun; a file it replaced (an atomic write over
    a linked one) replaces yours. Not the checkpoint files' private entries: the run's
    checkpoints hold those. Returns the names moved."""
    tops = private_tops(patterns)
    moved = []
    if not work.is_dir():
        return moved
    for entry in sorted(work.iterdir()):
        if entry.is_symlink() or any(fnmatch.fnmatch(entry.name, top) for top in tops):
            continue
        dest = workdir / entry.name
        if dest.exists() and dest.is_dir() != entry.is_dir():
            continue
        try:
            if entry.is_dir() and dest.is_dir():
                shutil.copytree(entry, dest, symlinks=True, dirs_exist_ok=True)
            else:
                shutil.move(entry, dest)
        except OSError:
            continue
        moved.append(entry.name)
    return moved


def restore_files(checkpoint: Path, node_rank: int, work: Path, ckpt: Path,
                  patterns: list[str]) -> set[str]:
    """Copy this node's files of a committed checkpoint back, over node 0's (a snapshot rank 0
    wrote is every node's; a node that wrote files of its own has those). Returns the names
    ("work/<rel>", "checkpoint_dir/<rel>") that came from node 0 alone: not this node's own.
    Only files the patterns name go back into the script's folder, and never through one of
    its links (those lead into trainer.workdir): a checkpoint from elsewhere (resume=<uri>)
    listing scripts/train.py must not replace your code."""
    own = copy_node_files(checkpoint / f"node_{node_rank}", work, ckpt, patterns)
    if node_rank == 0:
        return set()
    return copy_node_files(checkpoint / "node_0", work, ckpt, patterns, keep=own) - own


def copy_node_files(source: Path, work: Path, ckpt: Path, patterns: list[str],
                    keep: set[str] = frozenset()) -> set[str]:
    """A node folder's files into the script's folders, but those named in ``keep``; returns
    the names copied."""
    copied = set()
    for kind, target in ((WORK, work), (CKPT_DIR, ckpt)):
        base = source / kind
        if not base.is_dir():
            continue
        for path in sorted(p for p in base.rglob("*") if p.is_file()):
            rel = path.relative_to(base).as_posix()
            name = f"{kind}/{rel}"
            if name in keep or (kind == WORK and not named_by(rel, patterns)):
                continue
            if through_link(target, rel):
                continue
            dest = target / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
            copied.add(name)
    return copied


def named_by(rel: str, patterns: list[str]) -> bool:
    """Whether a checkpoint pattern names this file, as the watcher's glob took it: itself
    (``**`` spans folders), or a folder above it (``ckpt``)."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(glob_match(prefix, pattern.rstrip("/")) for pattern in patterns for prefix in prefixes)


def signature(path: Path) -> tuple | None:
    try:
        return signature_of(os.stat(path))
    except OSError:
        return None


def signature_of(st: os.stat_result) -> tuple:
    """What a write changes: the size, mtime and ctime (a file taken was still for a poll, so
    a write now gets a later time even on a coarse clock), and the inode (a file replaced)."""
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def copy_bytes(source, dest) -> None:
    shutil.copyfileobj(source, dest, 1 << 20)


def copy_unchanged(source: Path, dest: Path, expected: tuple) -> bool:
    """Copy ``source`` to ``dest`` if it is the version ``expected`` describes and is still
    that version when the copy ends (the open file's fstat, and its path still names it).
    False, with no copy left at ``dest``, when it is not: a write during the copy tears it."""
    try:
        fd = os.open(source, os.O_RDONLY)
    except OSError:  # removed meanwhile
        return False
    try:
        whole = signature_of(os.fstat(fd)) == expected
        if whole:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(fd, "rb", closefd=False) as src, open(dest, "wb") as out:
                copy_bytes(src, out)
            whole = signature_of(os.fstat(fd)) == expected and signature(source) == expected
    except OSError:
        whole = False
    finally:
        os.close(fd)
    if not whole:
        dest.unlink(missing_ok=True)
    return whole


def open_files() -> set[str]:
    """Every file some process of ours has open (Linux /proc)."""
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                found.add(os.readlink(f"{fd_dir}/{fd}"))
            except OSError:
                continue
    return found


@dataclass
class CheckpointWatcher:
    """Watches one node's checkpoint files; keeps closed, still copies aside in ``pending``."""

    work: Path
    ckpt: Path
    patterns: list[str]
    pending_root: Path
    # The restored files that were node 0's (restore_files): not this node's own until it
    # writes them, so not kept under node_<n> (a later restart would take that stale copy
    # over node 0's newer one).
    borrowed: set[str] = field(default_factory=set)
    taken: dict[str, tuple] = field(default_factory=dict)  # name -> signature last taken
    seen: dict[str, tuple] = field(default_factory=dict)  # name -> signature at the last poll
    not_own: set[str] = field(default_factory=set)  # restored from node 0, not rewritten since
    ever_written: bool = False

    def __post_init__(self) -> None:
        self.pending_root.mkdir(parents=True, exist_ok=True)
        self.taken = {name: sig for name, sig in self.current().items()}  # restored files
        self.not_own = set(self.borrowed) & set(self.taken)

    def current(self) -> dict[str, tuple]:
        """name ("work/<rel>" or "checkpoint_dir/<rel>") -> signature, for every file."""
        files: dict[str, tuple] = {}
        for pattern in self.patterns:
            for match in self.work.glob(pattern):
                # a folder named (ckpt, out/checkpoint-*) stands for every file under it
                found = match.rglob("*") if match.is_dir() and not match.is_symlink() else [match]
                for path in found:
                    if path.is_file() and not path.is_symlink():
                        files[f"{WORK}/{path.relative_to(self.work)}"] = signature(path)
        for path in self.ckpt.rglob("*"):
            if path.is_file():
                files[f"{CKPT_DIR}/{path.relative_to(self.ckpt)}"] = signature(path)
        return {k: v for k, v in files.items() if v is not None}

    def path_of(self, name: str) -> Path:
        kind, _, rel = name.partition("/")
        return (self.work if kind == WORK else self.ckpt) / rel

    def poll(self, settled: bool = False) -> bool:
        """Copy aside what changed and is closed and still (``settled``: the writers have
        exited, so closed is enough). True when nothing is in flux and something is new."""
        now = self.current()
        changed = {n: s for n, s in now.items() if self.taken.get(n) != s}
        if not changed:
            self.seen = now
            return self.has_new()
        in_use = open_files()
        closed = {n: s for n, s in now.items() if str(self.path_of(n)) not in in_use}
        in_flux = False
        for name, sig in changed.items():
            path = self.path_of(name)
            # still: the same at the last poll, when it was closed (a file open then may be
            # torn by a kill since, however unchanged it looks now)
            still = settled or self.seen.get(name) == sig
            if not still or name not in closed:
                in_flux = True
                continue
            if not copy_unchanged(path, self.pending_root / name, sig):
                in_flux = True  # written again while copied: the next poll tries again
                continue
            self.taken[name] = sig
            self.not_own.discard(name)
            self.ever_written = True
        self.seen = closed
        return not in_flux and self.has_new()

    def has_new(self) -> bool:
        return any(p.is_file() for p in self.pending_root.rglob("*"))

    def write_into(self, folder: Path, node_rank: int) -> Future | None:
        """Move the copies aside into ``folder``/node_<n>/, and copy the unchanged files too:
        a checkpoint holds all of the node's files, not only the new ones. An unchanged file
        rewritten since it was taken (before or during its copy) has no whole copy of the
        version taken: the returned future raises, and the checkpoint is not committed (a
        warning; the watcher takes the new version for the next one)."""
        base = folder / f"node_{node_rank}"
        moved = self.move_pending(base)
        rewritten = [name for name in self.unchanged(moved) if not self.copy_taken(name, base)]
        shutil.rmtree(self.pending_root, ignore_errors=True)
        self.pending_root.mkdir(parents=True, exist_ok=True)
        if not rewritten:
            return None
        refused: Future = Future()
        refused.set_exception(RewrittenDuringSave(
            f"node {node_rank}'s {', '.join(rewritten)} changed while it was being copied: "
            "this checkpoint would hold a torn file; the next one takes it"))
        return refused

    def move_pending(self, base: Path) -> set[str]:
        moved = set()
        for path in sorted(p for p in self.pending_root.rglob("*") if p.is_file()):
            name = str(path.relative_to(self.pending_root))
            dest = base / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, dest)
            moved.add(name)
        return moved

    def unchanged(self, moved: set[str]) -> list[str]:
        """The files taken earlier that this checkpoint holds too (not node 0's borrowed)."""
        return [name for name in self.taken if name not in moved and name not in self.not_own]

    def copy_taken(self, name: str, base: Path) -> bool:
        """Copy the version of ``name`` that was taken into the checkpoint; False when the file
        changed since then. A file the script removed is left out of the checkpoint (and
        forgotten: written again, it is new)."""
        source, sig = self.path_of(name), self.taken[name]
        if copy_unchanged(source, base / name, sig):
            return True
        if not os.path.lexists(source):
            del self.taken[name]
            return True
        log.warning("%s changed while it was copied into a checkpoint: not committed", source)
        return False
