"""A checkpoint is a folder ``step_<n>`` holding every rank's files plus ``manifest.json``.

Writing is a multi-writer protocol. Each rank uploads its own files into the folder, under its
attempt's own prefix (``<attempt>/<name>``: a straggler of a dead attempt, still uploading,
cannot touch a newer attempt's committed files), checks the sizes the store reports, then
writes a *part record* (``.parts/<attempt>-rank_<r>.json``: its files with size, SHA-256 and
where each is stored). Rank 0 waits until every rank of its attempt has written
one, then writes the manifest, which lists every rank's files: the commit. A folder without a
manifest (a rank died mid-write, an upload failed) is never taken as a checkpoint; a folder
whose files disagree with the manifest is corrupt and is skipped in favour of the next older
one. Committed checkpoints are never overwritten. On a local store every file, part record
and folder is fsync'ed before the manifest's rename commits, and the rename before the commit
returns (local_disk). What a manifest or part record says is checked before anything acts on it
(manifest_checks): a record that fails is corruption, never a traceback.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

import pyarrow.fs as pafs

from orchestrator.checkpoint import local_disk
from orchestrator.checkpoint.local_disk import CHUNK
from orchestrator.checkpoint.manifest_checks import (
    MANIFEST,
    MAX_RECORD_BYTES,
    CorruptCheckpoint,
    check_manifest,
    check_part_record,
    listed_files,
    parse_record,
)
from orchestrator.checkpoint.names import check_names
from orchestrator.checkpoint.retry import DEFAULT_BACKOFF, Backoff, with_retries
from orchestrator.errors import one_line
from orchestrator.storage.location import StorageSpec, join, refused_credentials

log = logging.getLogger(__name__)

PARTS = ".parts"
# Wait for the object store's pending part uploads every this many bytes: pyarrow's S3
# stream otherwise buffers every part not yet sent, up to the whole file (a 580 MiB shard
# added 1.0x its size to the rank's memory; with this, ~60 MiB, and the upload was faster).
IN_FLIGHT = 64 << 20
_STEP_DIR = re.compile(r"^step_(\d{9})$")
# Reading the checkpoint a run starts from: an outage of up to two minutes is waited out.
READING_BACKOFF = Backoff(1.0, 10.0, 120.0)


class WriteNeverCommits(CorruptCheckpoint):
    """What write() made cannot commit, and every later checkpoint of the run would be made
    the same way: the run stops at once (worker_api)."""

    advice = ""


class SameFileFromTwoRanks(WriteNeverCommits):
    """Two ranks' write() made the same file: every later checkpoint of the run would too."""

    advice = "each rank must write files of its own names, or none"


class ReservedFileName(WriteNeverCommits):
    """write() made a file named as the checkpoint's own manifest.json, which would replace it
    in every view of the checkpoint (and, linked, the stored one)."""

    advice = "name it otherwise (state.json, meta.json)"


class CheckpointUnreachable(RuntimeError):
    """A committed checkpoint could not be read for a reason of the disk, the network or the
    credentials, not of its content: older ones would fail alike, down to a silent step 0.
    Raised after READING_BACKOFF's retries: the run stops with it rather than restarting."""

    retry = False


class NotEnoughSpace(RuntimeError):
    """The local disk cannot hold the checkpoint's files: not worth retrying, not corruption."""

    retry = False


UNREACHABLE_ADVICE = ("the run does not start over without it; fix the disk, the network or "
                      "the credentials and run the same command again")


def unreachable(ref: CheckpointRef, exc: BaseException) -> CheckpointUnreachable:
    return CheckpointUnreachable(f"the checkpoint {ref.uri} could not be read "
                                 f"({one_line(exc)[:300]}): {UNREACHABLE_ADVICE}")


class IncompleteCheckpoint(RuntimeError):
    """Not every rank's part arrived in time: the checkpoint is not committed."""


@dataclass(frozen=True)
class CheckpointRef:
    step: int
    uri: str  # as the user would write it (scheme kept for s3://)
    path: str  # inside the filesystem


@dataclass
class SavedCheckpoint:
    ref: CheckpointRef
    bytes: int
    save_s: float
    meta: dict = field(default_factory=dict)


def stored_at(name: str, entry: dict) -> str:
    """Where a checkpoint's file lies inside its step folder: under its writer's attempt
    (``key``), or at its name in checkpoints written before attempts had prefixes."""
    return entry.get("key", name)


def step_dir(step: int) -> str:
    return f"step_{step:09d}"


def step_of(name: str) -> int | None:
    """The step a checkpoint folder's name says (``step_000000100`` -> 100), else None."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def local_files(directory: Path) -> list[str]:
    """Every file under a directory, as sorted relative POSIX paths; a linked file or folder
    (a tokenizer folder linked in, latest -> step_100) counts as what it points to, under its
    own name too; a link back up the tree is not followed."""
    found: list[str] = []

    def walk(folder: Path, rel: PurePosixPath, ancestors: frozenset[str]) -> None:
        real = os.path.realpath(folder)
        if real in ancestors:
            return
        for entry in os.scandir(folder):
            path = Path(entry.path)
            if path.is_dir():
                walk(path, rel / entry.name, ancestors | {real})
            elif path.is_file():
                found.append((rel / entry.name).as_posix())

    walk(directory, PurePosixPath(), frozenset())
    return sorted(found)


def through_link(directory: Path, name: str) -> bool:
    """Whether ``directory/name`` is, or lies under, a symbolic link inside ``directory``."""
    path = directory
    for part in name.split("/"):
        path = path / part
        if path.is_symlink():
            return True
    return False


def _same_manifest(path: Path, manifest: dict) -> bool:
    try:
        return json.loads(path.read_text()) == manifest
    except (OSError, ValueError):
        return False


class CheckpointStore:
    """The committed checkpoints under one root URI (one run)."""

    def __init__(self, spec: StorageSpec):
        self.spec = spec
        self.fs, self.root = spec.filesystem()
        self.is_local = isinstance(self.fs, pafs.LocalFileSystem)
        self._sequence: int | None = None  # the newest commit's sequence, once read (commit)

    def _retry(self, what: str, operation, backoff: Backoff):
        return with_retries(what, operation, backoff, renew=self._renew)

    def _renew(self, error: OSError) -> None:
        """Credentials refused (expired, rotated): open the filesystem again before the next
        try, so that credentials from the AWS chain (a profile's file rewritten, a refreshed
        web identity token) are read anew; fixed keys stay what they are."""
        if self.spec.is_s3 and self.spec.credentials is None and refused_credentials(error):
            self.fs, _ = self.spec.filesystem()

    def ref(self, step: int) -> CheckpointRef:
        name = step_dir(step)
        return CheckpointRef(step, join(self.spec.uri, name), join(self.root, name))

    # -- reading -----------------------------------------------------------------------
    def committed(self) -> list[CheckpointRef]:
        """Committed checkpoints, oldest first."""
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except FileNotFoundError:
            return []
        refs = []
        for info in infos:
            match = _STEP_DIR.match(info.base_name)
            if info.type == pafs.FileType.Directory and match and self.is_committed(int(match.group(1))):
                refs.append(self.ref(int(match.group(1))))
        return sorted(refs, key=lambda r: r.step)

    def _linked(self, path: str) -> bool:
        """Whether a local store's ``path`` is a symbolic link (an object store has none)."""
        return self.is_local and os.path.islink(path)

    def latest(self) -> CheckpointRef | None:
        refs = self.committed()
        return refs[-1] if refs else None

    def is_committed(self, step: int, backoff: Backoff | None = None) -> bool:
        """Whether the step's manifest is there; retried within ``backoff`` if one is given."""
        def check() -> bool:
            path = self.ref(step).path
            if self._linked(path):  # a step folder linked in is never taken (nor written)
                return False
            return self.fs.get_file_info(join(path, MANIFEST)).type == pafs.FileType.File
        if backoff is None:
            return check()
        return self._retry(f"checking {self.ref(step).uri}", check, backoff)

    def read_manifest(self, ref: CheckpointRef) -> dict:
        """The manifest, every field a reader acts on checked (manifest_checks: names that
        could leave the folder, implausible sizes, a malformed data position...): what reads it
        can trust it. CorruptCheckpoint otherwise, as for one too large to read."""
        where = f"{ref.uri}/{MANIFEST}"
        manifest = parse_record(self._read_record(ref.step, MANIFEST, where), where)
        check_manifest(manifest, where)
        return manifest

    def _read_record(self, step: int, name: str, where: str) -> bytes:
        """A manifest or part record (``name`` inside the step's folder), whole; refused
        unread beyond MAX_RECORD_BYTES, as the store reports its size; in a local store, never
        through a link."""
        if self.is_local:
            return local_disk.read_plain(self.root, f"{step_dir(step)}/{name}", where,
                                         MAX_RECORD_BYTES)
        with self.fs.open_input_file(join(self.ref(step).path, name)) as f:
            size = f.size()
            if size > MAX_RECORD_BYTES:
                raise CorruptCheckpoint(f"{where} holds {size} bytes, more than the "
                                        f"{MAX_RECORD_BYTES} it may")
            return f.read(size)

    def read_run_record(self, name: str) -> dict | None:
        """A record the driver keeps beside the run's checkpoints (finished.json), or None
        where there is none or it does not parse (a crafted or torn one is not acted on)."""
        where = f"{self.spec.uri}/{name}"
        try:
            if self.is_local:
                data = local_disk.read_plain(self.root, name, where, MAX_RECORD_BYTES)
            else:
                with self.fs.open_input_file(join(self.root, name)) as f:
                    if f.size() > MAX_RECORD_BYTES:
                        return None
                    data = f.read()
            record = parse_record(data, where)
        except (FileNotFoundError, CorruptCheckpoint):
            return None
        return record if isinstance(record, dict) else None

    def write_run_record(self, name: str, record: dict) -> None:
        self._write_atomically(join(self.root, name), json.dumps(record, sort_keys=True).encode())

    def discard_run_record(self, name: str) -> None:
        try:
            self.fs.delete_file(join(self.root, name))
        except FileNotFoundError:
            pass

    def discard(self, ref: CheckpointRef) -> None:
        """Delete a committed checkpoint: the manifest first, so a half-deleted folder is
        never seen as committed."""
        self.fs.delete_file(join(ref.path, MANIFEST))
        self.fs.delete_dir(ref.path)

    def fetch(self, ref: CheckpointRef, cache: Path) -> Path:
        """A local directory ``cache/step_<n>`` holding the checkpoint's files (every rank's)
        and its manifest, nothing else, each file's size and SHA-256 checked against the
        manifest: the same view from every store. A local store's files are linked in
        (local_disk.link_checked); an object store's are downloaded (hashed as they stream)."""
        return self.fetch_some(ref, cache, None)[0]

    def fetch_some(self, ref: CheckpointRef, cache: Path,
                   choose: Callable[[str], bool] | None) -> tuple[Path, int]:
        """``fetch`` of the files ``choose(name)`` accepts (None: all), and the bytes fetched.
        Called again for the same checkpoint and cache, the folder keeps the files it has and
        gets the newly chosen ones too: a rank fetches only what it loads (its own shards, or
        rank 0's files), never the whole checkpoint for a part of it."""
        manifest = self.read_manifest(ref)
        folder = cache / step_dir(ref.step)
        if self.is_local and folder.resolve() == Path(ref.path).resolve():
            raise ValueError(f"the cache {cache} is the checkpoint's own store")  # rmtree below
        # Adding to what an earlier call fetched of the same commit (a rank asking for more);
        # a whole fetch, or another commit of the step (one rewritten), starts afresh.
        adding = choose is not None and _same_manifest(folder / MANIFEST, manifest)
        if not adding:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
        wanted = {name: entry for name, entry in manifest["files"].items()
                  if (choose is None or choose(name)) and not (folder / name).exists()}
        need = sum(entry["bytes"] for entry in wanted.values())
        try:
            if not self.is_local:  # downloads: the disk must hold them (links take no room)
                self._check_stored_sizes(ref, wanted)  # a forged size is not a disk too small
                free = shutil.disk_usage(folder).free
                if need > free:
                    raise NotEnoughSpace(f"{need} bytes needed in {cache}, {free} free")
            for name, entry in wanted.items():
                if self.is_local:
                    local_disk.link_checked(self.root, f"{step_dir(ref.step)}/{stored_at(name, entry)}",
                                            entry, folder / name, f"{ref.uri}/{name}")
                else:
                    self._download(ref, name, entry, folder / name)
        except BaseException:
            if adding:  # what this call added goes; what the folder had stays
                for name in wanted:
                    (folder / name).unlink(missing_ok=True)
            else:
                shutil.rmtree(folder, ignore_errors=True)  # a failed try leaves nothing behind
            raise
        if not adding:
            manifest_copy = folder / MANIFEST
            manifest_copy.unlink(missing_ok=True)  # never written through a link into the store
            manifest_copy.write_text(json.dumps(manifest, indent=1))
        return folder, need

    def _check_stored_sizes(self, ref: CheckpointRef, wanted: Mapping[str, dict]) -> None:
        """Each file to download is in the object store at its listed size (one HEAD each)."""
        paths = [join(ref.path, stored_at(name, entry)) for name, entry in wanted.items()]
        for (name, entry), info in zip(wanted.items(), self.fs.get_file_info(paths), strict=True):
            if info.type != pafs.FileType.File or info.size != entry["bytes"]:
                stored = "none" if info.type != pafs.FileType.File else f"{info.size} bytes"
                raise CorruptCheckpoint(f"{ref.uri}/{name} is missing or has the wrong size "
                                        f"({stored} stored, {entry['bytes']} listed)")

    def _download(self, ref: CheckpointRef, name: str, entry: dict, target: Path) -> None:
        """One file, streamed into a fresh temporary name beside ``target`` and moved into
        place only once its size and hash match: a bad file never sits under its name, and
        one longer than listed stops at its listed size."""
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".download-")
        try:
            digest, size = hashlib.sha256(), 0
            with (os.fdopen(fd, "wb") as dst,
                  self.fs.open_input_stream(join(ref.path, stored_at(name, entry))) as src):
                while (block := src.read(CHUNK)) and size <= entry["bytes"]:
                    digest.update(block)
                    dst.write(block)
                    size += len(block)
            if size != entry["bytes"] or digest.hexdigest() != entry["sha256"]:
                raise CorruptCheckpoint(f"{ref.uri}/{name} does not match its manifest")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def newest_intact(self, cache: Path, skipped: list[str] | None = None,
                      corrupt: list[CheckpointRef] | None = None,
                      backoff: Backoff = READING_BACKOFF,
                      ) -> tuple[CheckpointRef, Path] | None:
        """The newest checkpoint whose files match their manifest, fetched. Those whose
        content is wrong (a file that differs, is missing or is listed badly) are logged,
        described in ``skipped`` and listed in ``corrupt``, and the next older one is tried.
        An error of the disk, the network or the credentials is retried within ``backoff``,
        then raised as CheckpointUnreachable: it is not corruption, and falling back past it
        would start the run over."""
        try:
            refs = self._retry(f"listing {self.spec.uri}", self.committed, backoff)
        except OSError as exc:
            raise CheckpointUnreachable(f"the checkpoints in {self.spec.uri} could not be listed "
                                        f"({one_line(exc)[:300]}): {UNREACHABLE_ADVICE}") from exc
        for ref in reversed(refs):
            try:
                return ref, self._retry(f"reading {ref.uri}",
                                        lambda r=ref: self._fetch_content(r, cache), backoff)
            except (CorruptCheckpoint, ValueError, KeyError, TypeError) as exc:
                reason = f"checkpoint {ref.uri} is unreadable ({exc}); trying an older one"
                log.warning(reason)
                if skipped is not None:
                    skipped.append(reason)
                if corrupt is not None:
                    corrupt.append(ref)
            except (OSError, NotEnoughSpace) as exc:
                raise unreachable(ref, exc) from exc
        return None

    def fetch_loaded(self, ref: CheckpointRef, cache: Path, choose: Callable[[str], bool],
                     backoff: Backoff = READING_BACKOFF) -> tuple[Path, int]:
        """A rank's ``fetch_some`` of the files it loads from the checkpoint rank 0 chose: an
        error of the disk, the network or the credentials is retried within ``backoff``, then
        raised as CheckpointUnreachable, as for rank 0. Every file is checked, size and SHA-256:
        rank 0 checked the same local files, but a writer of the store may have changed them
        since."""
        try:
            return self._retry(f"reading {ref.uri}",
                               lambda: self._fetch_content(ref, cache, choose), backoff)
        except (OSError, NotEnoughSpace) as exc:
            raise unreachable(ref, exc) from exc

    def _fetch_content(self, ref: CheckpointRef, cache: Path,
                       choose: Callable[[str], bool] | None = None):
        """fetch, where a file or manifest gone since the listing is the checkpoint's fault."""
        try:
            if choose is None:
                return self.fetch(ref, cache)
            return self.fetch_some(ref, cache, choose)
        except FileNotFoundError as exc:
            raise CorruptCheckpoint(f"{ref.uri}: {one_line(exc)}") from exc

    def set_aside(self, ref: CheckpointRef) -> str:
        """Uncommit a corrupt checkpoint: its manifest moves to ``manifest.corrupt-<time>.json``
        beside its files (kept for a look, never read), so that training writes the step again
        when it gets there instead of keeping the corrupt one as committed. Returns the new name."""
        aside = join(ref.path, f"manifest.corrupt-{int(time.time())}.json")
        self.fs.move(join(ref.path, MANIFEST), aside)
        return aside

    def load(self, ref: CheckpointRef) -> tuple[dict[str, bytes], dict]:
        """The files of a checkpoint as bytes, and its meta, checked against the manifest
        (for small checkpoints and tests; workers use fetch)."""
        manifest = self.read_manifest(ref)
        files = {}
        for name, entry in manifest["files"].items():
            key, where = stored_at(name, entry), f"{ref.uri}/{name}"
            if self.is_local:
                data = local_disk.read_plain(self.root, f"{step_dir(ref.step)}/{key}", where,
                                             entry["bytes"])
            else:
                with self.fs.open_input_stream(join(ref.path, key)) as f:
                    data = f.read(entry["bytes"] + 1)
            if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise CorruptCheckpoint(f"{ref.uri}/{name} does not match its manifest")
            files[name] = data
        return files, manifest.get("meta", {})

    # -- writing: one rank's part --------------------------------------------------------
    def upload_part(self, step: int, rank: int, attempt: str, local: Path,
                    backoff: Backoff = DEFAULT_BACKOFF, note: dict | None = None) -> dict[str, dict]:
        """Store the files under ``local`` (this rank's part of checkpoint ``step``), check
        their stored sizes, then write the part record (with ``note`` in it). Returns
        {name: {bytes, sha256}}.
        A local store moves the files in (a rename on the same disk); others upload them."""
        ref = self.ref(step)
        names = local_files(local)
        if MANIFEST in names:
            raise ReservedFileName(f"rank {rank}'s write() made {MANIFEST!r} in the checkpoint at "
                                   f"step {step}: that name is the checkpoint's own manifest's")
        check_names(names, f"the snapshot {local} of {ref.uri}", CorruptCheckpoint)
        if self._linked(ref.path):  # its files would land wherever the link points
            raise CorruptCheckpoint(f"{ref.uri} is a symbolic link: a checkpoint is never "
                                    "written through one")
        self._retry(f"creating {ref.uri}", lambda: self.fs.create_dir(ref.path, recursive=True),
                    backoff)
        entries = {}
        for name in names:
            key = f"{attempt}/{name}"
            entries[name] = {**self._retry(
                f"uploading {ref.uri}/{key}",
                lambda n=name, k=key: self._store_file(local / n, join(ref.path, k),
                                                       through_link(local, n)), backoff),
                "key": key}
        for name, entry in entries.items():
            size = self._retry(f"checking {ref.uri}/{entry['key']}",
                               lambda k=entry["key"]: self.fs.get_file_info(join(ref.path, k)).size,
                               backoff)
            if size != entry["bytes"]:
                raise CorruptCheckpoint(f"{ref.uri}/{name}: {size} bytes stored, {entry['bytes']} sent")
        if self.is_local:  # the folders naming the files, durable before the part says "done"
            self._retry(f"syncing {ref.uri}", lambda: self._fsync_folders(
                ref, [e["key"] for e in entries.values()]), backoff)
        record = {"step": step, "rank": rank, "attempt": attempt, "files": entries, **(note or {})}
        self._retry(f"recording rank {rank}'s part of {ref.uri}",
                    lambda: self._write_atomically(join(ref.path, PARTS, part_name(attempt, rank)),
                                                   json.dumps(record).encode()), backoff)
        return entries

    def _store_file(self, local: Path, remote: str, linked: bool = False) -> dict:
        """``linked``: the file is reached through a link (the user's own): copied, not moved."""
        if self.is_local:  # moved or copied, then fsync'ed
            return local_disk.store_file(local, Path(remote), linked)
        digest, size = hashlib.sha256(), 0
        parent = remote.rsplit("/", 1)[0]
        self.fs.create_dir(parent, recursive=True)
        with open(local, "rb") as src, self.fs.open_output_stream(remote) as dst:
            while block := src.read(CHUNK):
                digest.update(block)
                dst.write(block)
                size += len(block)
                if size % IN_FLIGHT == 0:
                    dst.flush()  # waits for the parts sent so far; never sends a short part
        return {"bytes": size, "sha256": digest.hexdigest()}

    def give_up_part(self, step: int, rank: int, attempt: str, reason: str) -> None:
        """Tell rank 0 at once that this rank's part of ``step`` will not come (best effort, a
        short try: the store may be what failed), instead of leaving it to wait its deadline."""
        record = {"step": step, "rank": rank, "attempt": attempt, "failed": reason[:300]}
        try:
            self._retry("recording a part given up", lambda: self._write_atomically(
                join(self.ref(step).path, PARTS, part_name(attempt, rank)),
                json.dumps(record).encode()), Backoff(0.5, 1.0, 3.0))
        except OSError as exc:
            log.warning("could not tell rank 0 that rank %d's part of step %d will not come: %s",
                        rank, step, one_line(exc)[:200])

    # -- writing: rank 0's commit --------------------------------------------------------
    def parts(self, step: int, attempt: str, known: dict[int, dict] | None = None
              ) -> dict[int, dict]:
        """The part records of one attempt written so far: {rank: record}. One listing, and a
        read of each record not in ``known`` (those read by an earlier poll of the same wait:
        a part record is written once, atomically), so that a wait for N ranks reads each
        record once, not once per poll (scripts/bench.py scale counts the requests)."""
        selector = pafs.FileSelector(join(self.ref(step).path, PARTS), allow_not_found=True)
        found = {}
        for info in self.fs.get_file_info(selector):
            match = re.match(rf"^{re.escape(attempt)}-rank_(\d+)\.json$", info.base_name)
            if match and info.type == pafs.FileType.File:
                rank = int(match.group(1))
                if known and rank in known:
                    found[rank] = known[rank]
                    continue
                where = f"{self.ref(step).uri}/{PARTS}/{info.base_name}"
                record = parse_record(self._read_record(step, f"{PARTS}/{info.base_name}", where),
                                      where)
                found[rank] = check_part_record(record, where)
        return found

    def wait_for_parts(self, step: int, attempt: str, world_size: int,
                       backoff: Backoff = DEFAULT_BACKOFF, poll_s: float = 0.02) -> dict[int, dict]:
        """Every rank's part record of ``attempt``, polled until the backoff's deadline (its
        budget's, when it has one). A rank that gave its part up says so in its place (a
        ``failed`` record): the wait ends at once, naming it."""
        started = time.monotonic()
        deadline = backoff.end(started)
        where = f"listing the parts of {self.ref(step).uri}"
        found: dict[int, dict] = {}
        while True:
            # A listing error is retried like any other operation, within what is left of the
            # wait: the parts may all be there (it used to abandon the checkpoint at once).
            found = self._retry(where, lambda known=found: self.parts(step, attempt, known),
                                replace(backoff, until=deadline))
            failed = {r: p["failed"] for r, p in found.items() if "failed" in p}
            if failed:
                raise IncompleteCheckpoint(f"{self.ref(step).uri}: rank(s) {sorted(failed)} gave "
                                           f"their part up: {next(iter(failed.values()))}")
            if len(found) >= world_size:
                return found
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(found))
                raise IncompleteCheckpoint(f"{self.ref(step).uri}: no part from rank(s) {missing} "
                                           f"after {time.monotonic() - started:.0f} s")
            time.sleep(poll_s)
            poll_s = min(poll_s * 1.5, 0.5)

    def commit(self, step: int, parts: Mapping[int, dict], meta: dict,
               backoff: Backoff = DEFAULT_BACKOFF) -> SavedCheckpoint:
        """Write the manifest listing every rank's files: from now on the checkpoint exists.
        It carries the commit's sequence (one past the highest in the store), which retention
        goes by."""
        started = time.perf_counter()
        files: dict[str, dict] = {}
        for rank in sorted(parts):
            listed_files(parts[rank], f"rank {rank}'s part record of step {step}")
            for name, entry in parts[rank]["files"].items():
                if name in files:
                    raise SameFileFromTwoRanks(f"ranks {files[name]['rank']} and {rank} both wrote "
                                            f"{name!r} into the checkpoint at step {step}")
                files[name] = {**entry, "rank": rank}
        ref = self.ref(step)
        if self.is_local:  # each rank synced its folders, and its part record; .parts' entry:
            self._retry(f"syncing {ref.uri}", lambda: local_disk.fsync_folder(ref.path), backoff)
        sequence = self._retry(f"reading the commit order in {self.spec.uri}",
                               self._newest_sequence, backoff) + 1
        manifest = {"step": step, "world_size": len(parts), "files": files, "meta": meta,
                    "committed_at": time.time(), "sequence": sequence}
        self._retry(f"committing {ref.uri}",
                    lambda: self._write_atomically(join(ref.path, MANIFEST),
                                                   json.dumps(manifest, indent=1).encode()), backoff)
        self._sequence = sequence  # the rename is durable (write_atomically): retention may go
        total = sum(e["bytes"] for e in files.values())
        return SavedCheckpoint(ref, total, time.perf_counter() - started, meta)

    def save(self, step: int, files: Mapping[str, bytes], meta: dict | None = None,
             backoff: Backoff = DEFAULT_BACKOFF, staging: Path | None = None) -> SavedCheckpoint:
        """A whole checkpoint written by one process (tools and tests), through the same
        protocol: the files as rank 0's part of a one-rank attempt, then the commit."""
        check_names(files, f"the checkpoint at step {step}", CorruptCheckpoint)
        if self.is_committed(step):  # never overwrite a committed checkpoint
            return SavedCheckpoint(self.ref(step), 0, 0.0, meta or {})
        with tempfile.TemporaryDirectory(dir=staging) as tmp:
            for name, data in files.items():
                (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
                (Path(tmp) / name).write_bytes(data)
            part = self.upload_part(step, 0, "single", Path(tmp), backoff)
        return self.commit(step, {0: {"files": part}}, meta or {}, backoff)

    def _write_atomically(self, path: str, data: bytes) -> None:
        if self.is_local:  # a rename, the bytes fsync'ed before it and the folder after
            local_disk.write_atomically(path, data)
        else:
            with self.fs.open_output_stream(path) as f:  # an object PUT is atomic
                f.write(data)

    def _fsync_folders(self, ref: CheckpointRef, keys: list[str]) -> None:
        """fsync the folders of a local checkpoint holding ``keys``, the step's own folder and
        the two above it (local_disk.folders_of)."""
        for folder in local_disk.folders_of(ref.path, keys):
            local_disk.fsync_folder(folder)

    def prune(self, keep: int, protect: set[int] = frozenset()) -> list[int]:
        """Delete all but the ``keep`` last committed checkpoints; never one in ``protect``.
        By commit order, not step: a run that resumed from an older step (the newer ones
        unreadable) writes lower steps than those, and they are its newest work."""
        if keep <= 0:
            return []
        refs = sorted(self.committed(), key=self.commit_order)
        doomed = [r for r in refs[:-keep] if r.step not in protect]
        for ref in doomed:
            self.discard(ref)
        return [r.step for r in doomed]

    def commit_order(self, ref: CheckpointRef) -> tuple[int, int]:
        """Where a committed checkpoint stands in commit order: its manifest's sequence (0
        where it has none: written before there was one), then its step. A manifest that
        does not parse (or is too large, or a link) comes first; one that cannot be read
        raises (nothing is deleted).
        A sequence, not the clock: the nodes that commit one after another may disagree."""
        where = f"{ref.uri}/{MANIFEST}"
        try:
            sequence = parse_record(self._read_record(ref.step, MANIFEST, where), where).get(
                "sequence", 0)
        except CorruptCheckpoint:
            sequence = -1
        return (sequence if type(sequence) is int else 0, ref.step)

    def _newest_sequence(self) -> int:
        """The highest sequence among the committed manifests: read from all of them at this
        store's first commit, then counted on by its own commits."""
        if self._sequence is None:
            self._sequence = max((self.commit_order(r)[0] for r in self.committed()), default=0)
        return self._sequence


def part_name(attempt: str, rank: int) -> str:
    return f"{attempt}-rank_{rank:05d}.json"


def open_source(spec: StorageSpec) -> tuple[CheckpointStore, CheckpointRef] | None:
    """``resume=<uri>``: a committed checkpoint folder, or a run folder (its newest one)."""
    fs, path = spec.filesystem()
    if fs.get_file_info(join(path, MANIFEST)).type == pafs.FileType.File:
        parent_uri, name = spec.uri.rstrip("/").rsplit("/", 1)
        match = _STEP_DIR.match(name)
        if not match:
            return None
        store = CheckpointStore(StorageSpec(parent_uri, spec.endpoint, spec.region, spec.credentials))
        ref = next((r for r in store.committed() if r.step == int(match.group(1))), None)
        return (store, ref) if ref else None
    store = CheckpointStore(spec)
    ref = store.latest()
    return (store, ref) if ref else None
