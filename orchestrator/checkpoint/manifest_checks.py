"""What a manifest or a part record may hold, checked before anything acts on it.

Both come from storage that others may write (a shared bucket, a checkpoint someone
published) or that broke (a disk, a half-restored backup): whatever they say is data to check,
never to trust. A record that fails a check makes its checkpoint corrupt (CorruptCheckpoint):
the run takes the next older one, with a warning naming the file and why. Nothing here may
raise anything else: a TypeError or a MemoryError would stop the run instead.
"""

from __future__ import annotations

import json
import re

from orchestrator.checkpoint.names import check_names
from orchestrator.data.fingerprint import META_KEY as FINGERPRINT_KEY
from orchestrator.data.fingerprint import fingerprint_problem
from orchestrator.errors import one_line

MANIFEST = "manifest.json"
# A manifest lists ~200 bytes a file: 64 MiB is over 300,000 files. Anything larger is
# refused unread (a planted 10 GiB manifest.json would otherwise be read whole into memory).
MAX_RECORD_BYTES = 64 << 20
# No checkpoint file is a pebibyte: a listed size beyond is forged or broken (and would be
# taken for a disk too small, which stops the run, instead of for corruption).
MAX_FILE_BYTES = 1 << 50
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

# A checkpoint's data position (meta["data"]: worker_api's Batches and StreamedBatches,
# streaming's DataShare): the whole numbers it may hold, and the least each may be.
_POSITION_COUNTS = {"num_rows": 0, "global_batch": 1, "next_step": 0, "epoch": 0,
                    "batch_in_epoch": 0, "shards": 1, "window": 1}
_META_COUNTS = ("step", "world_size")


class CorruptCheckpoint(RuntimeError):
    pass


def parse_record(raw: bytes, where: str) -> dict:
    """A manifest's or part record's bytes as a JSON object (CorruptCheckpoint otherwise)."""
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." nested deep
        raise CorruptCheckpoint(f"{where} is not JSON ({one_line(exc)[:100]})") from None
    if not isinstance(record, dict):
        raise CorruptCheckpoint(f"{where} is not a JSON object")
    return record


def is_count(value: object, least: int = 0) -> bool:
    """A whole number of at least ``least`` (True and False are not numbers here)."""
    return type(value) is int and value >= least


def entry_problem(entry: object) -> str | None:
    """What is wrong with one file's entry ({bytes, sha256, key?, rank?}), or None."""
    if not isinstance(entry, dict):
        return "is not an object"
    size = entry.get("bytes")
    if not is_count(size) or size > MAX_FILE_BYTES:
        return f"has no plausible size ({size!r:.40} bytes)"
    if not (isinstance(entry.get("sha256"), str) and _SHA256.match(entry["sha256"])):
        return "has no sha256 (64 hex digits)"
    if "rank" in entry and not is_count(entry["rank"]):
        return f"names no rank ({entry['rank']!r:.40})"
    return None  # the key, where it has one, is checked as a name (listed_files)


def file_under_file(names) -> tuple[str, str] | None:
    """Two names of which one would be a folder of the other (``x`` and ``x/y``), or None:
    no folder can hold both, and making the second fails as the disk's error, not as the
    checkpoint's."""
    every = set(names)
    for name in every:
        parts = name.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if folder in every:
                return folder, name
    return None


def listed_files(manifest: object, where: str) -> dict[str, dict]:
    """A manifest's (or part record's) {name: {bytes, sha256, ...}}, every name, place and
    entry checked."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CorruptCheckpoint(f"{where} lists no files")
    check_names(files, where, CorruptCheckpoint)
    for name, entry in files.items():
        problem = entry_problem(entry)
        if problem is not None:
            raise CorruptCheckpoint(f"{where}: the entry of {name!r} {problem}")
    check_names([entry.get("key", name) for name, entry in files.items()], where,
                CorruptCheckpoint)
    clash = file_under_file([*files, MANIFEST])  # the view holds manifest.json beside them
    if clash is not None:
        raise CorruptCheckpoint(f"{where} lists the file {clash[1]!r} under {clash[0]!r}, "
                                "which is a file too")
    return files


def check_manifest(manifest: dict, where: str) -> dict[str, dict]:
    """Every field of a manifest that a reader acts on; returns its files."""
    files = listed_files(manifest, where)
    for key in ("step", "world_size", "sequence"):
        if key in manifest and type(manifest[key]) is not int:
            raise CorruptCheckpoint(f"{where}: {key} is {manifest[key]!r:.40}, not a whole number")
    meta = manifest.get("meta", {})
    if not isinstance(meta, dict):
        raise CorruptCheckpoint(f"{where}: meta is not an object")
    for key in _META_COUNTS:
        if key in meta and not is_count(meta[key]):
            raise CorruptCheckpoint(f"{where}: meta.{key} is {meta[key]!r:.40}, not a count")
    if meta.get("data") is not None:
        problem = position_problem(meta["data"])
        if problem is not None:
            raise CorruptCheckpoint(f"{where}: its data position (meta.data) {problem}")
    if meta.get(FINGERPRINT_KEY) is not None:
        problem = fingerprint_problem(meta[FINGERPRINT_KEY])
        if problem is not None:
            raise CorruptCheckpoint(f"{where}: its data's digests (meta.{FINGERPRINT_KEY}) {problem}")
    return files


def position_problem(position: object) -> str | None:
    """What is wrong with a data position, or None: what a resume reads of it (the run plan,
    the stream's check of changed data, the batch order's check) must be what it expects."""
    if not isinstance(position, dict):
        return "is not an object"
    for key, least in _POSITION_COUNTS.items():
        if key in position and not is_count(position[key], least):
            return f"has {key}={position[key]!r:.40}, not a whole number of at least {least}"
    if "seed" in position and type(position["seed"]) is not int:
        return f"has seed={position['seed']!r:.40}, not a whole number"
    if ("num_rows" in position) != ("global_batch" in position):
        return "has one of num_rows and global_batch without the other"
    if "streamed" in position and not isinstance(position["streamed"], bool):
        return "says streamed neither true nor false"
    if position.get("streamed") or "manifest" in position:
        return data_summary_problem(position.get("manifest"))
    return None


def data_summary_problem(summary: object) -> str | None:
    """What is wrong with a position's summary of the data (Manifest.summary()), or None."""
    if not isinstance(summary, dict):
        return "has no summary of the data (manifest)"
    if "digest" in summary and not isinstance(summary["digest"], str):
        return "has a data digest that is not a string"
    if "rows" in summary and not is_count(summary["rows"]):
        return "has a row count that is not a count"
    files = summary.get("files", {})
    if not isinstance(files, dict) or not all(
            isinstance(sizes, list) and all(type(v) is int for v in sizes)
            for sizes in files.values()):
        return "lists its data files badly (each: [size, mtime_ns])"
    return None


def check_part_record(record: dict, where: str) -> dict:
    """A part record as rank 0 reads it while waiting: a failed part's reason, or the timings
    it takes the longest of (its files are checked at the commit: listed_files)."""
    if "failed" in record and not isinstance(record["failed"], str):
        raise CorruptCheckpoint(f"{where}: its failure is not a message")
    for key in ("save_s", "write_s"):
        value = record.get(key, 0.0)
        if type(value) not in (int, float) or not value >= 0:  # NaN fails too
            raise CorruptCheckpoint(f"{where}: {key} is {value!r:.40}, not a duration")
    return record
