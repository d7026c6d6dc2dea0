"""The identity of parquet data, read on the driver from the files' footers alone: every file
(size, modification time) and every row group (rows, bytes, its first row's global id).

Streamed runs (orchestrator/data/stream_order.py) plan from it without reading a row; every
checkpoint keeps its digest and file list, so that a resume against changed data is refused
naming what changed. The bad inputs a footer reveals (no files, schemas that differ, a row
group too large to stream) stop the command here, before any worker starts.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from orchestrator.errors import ConfigError, one_line

# CSV, TSV and JSON lines (compressed too): converted to parquet once (text_data.py)
TEXT_SUFFIXES = (".csv", ".tsv", ".jsonl", ".ndjson", ".json", ".csv.gz", ".tsv.gz", ".jsonl.gz",
                 ".ndjson.gz", ".json.gz", ".csv.bz2", ".jsonl.bz2")


@dataclass(frozen=True)
class DataFile:
    path: str  # inside the filesystem
    size: int
    mtime_ns: int | None  # None where the filesystem does not say


@dataclass(frozen=True)
class RowGroup:
    file: int  # index into Manifest.files
    index: int  # the row group's index in its file
    rows: int
    bytes: int  # compressed, as stored
    memory: int  # decoded, the columns read: what it takes in memory (an estimate)
    first_row: int  # the global id of its first row (files in path order, row groups in order)


@dataclass(frozen=True)
class Manifest:
    files: tuple[DataFile, ...]
    groups: tuple[RowGroup, ...]
    columns: tuple[str, ...]  # in the files' order; every one but the label is a feature
    label: str

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def memory(self) -> int:
        return sum(g.memory for g in self.groups)

    @property
    def features(self) -> tuple[str, ...]:
        return tuple(c for c in self.columns if c != self.label)

    def digest(self) -> str:
        """The files' row groups, not the memory estimate (it depends on the columns read)."""
        d = self.to_dict()
        d["groups"] = [{k: v for k, v in g.items() if k != "memory"} for g in d["groups"]]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def summary(self) -> dict:
        """What a checkpoint keeps: enough to name what changed since."""
        return {"digest": self.digest(), "rows": self.rows,
                "files": {f.path: [f.size, f.mtime_ns] for f in self.files}}

    def to_dict(self) -> dict:
        return {"files": [asdict(f) for f in self.files], "groups": [asdict(g) for g in self.groups],
                "columns": list(self.columns), "label": self.label}

    @classmethod
    def from_dict(cls, d: dict) -> Manifest:
        return cls(tuple(DataFile(**f) for f in d["files"]), tuple(RowGroup(**g) for g in d["groups"]),
                   tuple(d["columns"]), d["label"])


def what_changed(before: dict, now: Manifest) -> str | None:
    """One phrase naming how the data differs from a checkpoint's summary; None if it does not."""
    if before.get("digest") == now.digest():
        return None
    old, new = before.get("files", {}), now.summary()["files"]
    added, removed = sorted(set(new) - set(old)), sorted(set(old) - set(new))
    changed = sorted(p for p in set(old) & set(new) if list(old[p]) != list(new[p]))
    parts = []
    for word, paths in (("added", added), ("removed", removed), ("changed", changed)):
        if paths:
            more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
            parts.append(f"{len(paths)} file{'s' if len(paths) > 1 else ''} {word} ({paths[0]}{more})")
    if not parts:
        if before.get("rows") == now.rows:
            return None  # the same files, sizes, times and rows: a digest of another version
        parts.append(f"its row groups differ ({before.get('rows')} rows then, {now.rows} now)")
    return ", ".join(parts)


def list_files(fs: pafs.FileSystem, path: str, key: str) -> list[pafs.FileInfo]:
    """A file, every *.parquet under a folder (sorted; where it has none, its CSV and JSON
    lines files: orchestrator/data/text_data.py converts those), or a glob's matches."""
    if any(ch in path for ch in "*?["):
        base = path[: min(path.index(ch) for ch in "*?[" if ch in path)].rsplit("/", 1)[0]
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        found = [i for i in infos if i.type == pafs.FileType.File and glob_match(i.path, path)]
    else:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.File:
            found = [info]
        elif info.type == pafs.FileType.Directory:
            infos = [i for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
                     if i.type == pafs.FileType.File and not any(
                         part.startswith((".", "_")) for part in i.path[len(path):].split("/"))]
            found = [i for i in infos if i.path.endswith(".parquet")] or \
                [i for i in infos if i.path.endswith(TEXT_SUFFIXES)]
        else:
            raise ConfigError(f"{key}={path!r}: no such file or folder")
    if not found:
        raise ConfigError(f"{key}={path!r}: no parquet files there (a folder's *.parquet files, "
                          "or its CSV or JSON lines files, a glob, or one file)")
    return sorted(found, key=lambda i: i.path)


def glob_match(path: str, pattern: str) -> bool:
    """A shell's glob: ``*``, ``?`` and ``[...]`` within one folder level, ``**`` across any
    number; a hidden name (.x) only where the pattern spells its dot. So data/*.parquet
    leaves out data/holdout/x.parquet and data/_delta_log/..."""
    return _match(path.split("/"), pattern.split("/"))


def _match(parts: list[str], patterns: list[str]) -> bool:
    if not patterns:
        return not parts
    if patterns[0] == "**":  # any number of levels, none of them hidden (.ipynb_checkpoints)
        for i in range(len(parts) + 1):
            if _match(parts[i:], patterns[1:]):
                return True
            if i < len(parts) and parts[i].startswith("."):
                return False
        return False
    if not parts:
        return False
    name, pattern = parts[0], patterns[0]
    if name.startswith(".") and not pattern.startswith("."):
        return False
    return fnmatch.fnmatchcase(name, pattern) and _match(parts[1:], patterns[1:])


def read_manifest(fs: pafs.FileSystem, path: str, label: str, key: str = "data.path",
                  max_row_group_mb: float | None = None,
                  chosen: list[str] | None = None) -> Manifest:
    """Footers only: one small read at the end of each file."""
    infos = list_files(fs, path, key)
    files, groups, schema, first = [], [], None, 0
    unlabelled, first_unlabelled = 0, None
    for number, info in enumerate(infos):
        try:
            with fs.open_input_file(info.path) as handle:
                meta = pq.ParquetFile(handle).metadata
                file_schema = meta.schema.to_arrow_schema()
        except (OSError, pa.ArrowInvalid) as exc:
            raise ConfigError(f"{key}={path!r}: {info.path} is not a readable parquet file "
                              f"({one_line(exc)[:160]})") from None
        if schema is None:
            schema = file_schema
            if label not in schema.names:
                raise ConfigError(f"data.label={label!r} is not a column of {info.path}: "
                                  "columns are " + ", ".join(schema.names))
        elif not same_columns(file_schema, schema):
            raise ConfigError(f"{key}={path!r}: {info.path} has another schema than "
                              f"{infos[0].path} ({schema_difference(schema, file_schema, label)}); "
                              "every file must have the same columns and types")
        unlabelled += label_nulls(meta, label)
        first_unlabelled = first_unlabelled or (info.path if unlabelled else None)
        mtime = info.mtime_ns if info.mtime is not None else None
        files.append(DataFile(info.path, info.size, mtime))
        read = None if chosen is None else {*chosen, label}
        for index in range(meta.num_row_groups):
            rg = meta.row_group(index)
            stored = sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
            memory = decoded_bytes(rg, read)
            groups.append(RowGroup(number, index, rg.num_rows, stored, memory, first))
            first += rg.num_rows
            if max_row_group_mb and memory > max_row_group_mb * 2**20:
                raise ConfigError(
                    f"data.max_row_group_mb={max_row_group_mb:g}: row group {index} of "
                    f"{info.path} holds {memory / 2**20:.3g} MiB decoded, more than a "
                    "worker streams at once: write the data with smaller row groups (pyarrow's "
                    "row_group_size), raise data.max_row_group_mb, or hold it in memory "
                    "(data.stream=false)")
    groups = [g for g in groups if g.rows]
    if not groups:
        raise ConfigError(f"{key}={path!r}: the parquet files hold no rows")
    if unlabelled:
        raise ConfigError(f"{key}={path!r}: {unlabelled} rows have no label (data.label={label!r} "
                          f"is null there, the first in {first_unlabelled}): every row needs one")
    check_numeric(schema, label, key, path, chosen)
    return Manifest(tuple(files), tuple(groups), tuple(schema.names), label)


# A decoded value's bytes by parquet's physical type (features decode to float32: 4 at least).
# Footers give a dictionary-encoded column's encoded size, which can be 1/30 of its values'.
DECODED_WIDTH = {"BOOLEAN": 4, "INT32": 4, "FLOAT": 4, "INT64": 8, "DOUBLE": 8, "INT96": 12}


def decoded_bytes(rg: pq.RowGroupMetaData, read: set[str] | None) -> int:
    """A row group's columns that are read (None: all), as they take memory decoded: fixed-width
    values by their count, the others (text, bytes) by their uncompressed size."""
    total = 0
    for c in range(rg.num_columns):
        column = rg.column(c)
        if read is not None and column.path_in_schema not in read:
            continue
        width = DECODED_WIDTH.get(column.physical_type)
        total += rg.num_rows * width if width else column.total_uncompressed_size
    return total


def label_nulls(meta: pq.FileMetaData, label: str) -> int:
    """Rows whose label is null, from the footer's statistics (0 where it has none)."""
    if meta.num_row_groups == 0:
        return 0
    rg = meta.row_group(0)
    column = next((c for c in range(rg.num_columns) if rg.column(c).path_in_schema == label), None)
    if column is None:
        return 0
    nulls = 0
    for index in range(meta.num_row_groups):
        stats = meta.row_group(index).column(column).statistics
        if stats is not None and stats.has_null_count:
            nulls += stats.null_count
    return nulls


def same_columns(a: pa.Schema, b: pa.Schema) -> bool:
    """The same column names and types, in the same order (a column declared non-null in one
    file and nullable in another is the same column: its values are checked for nulls)."""
    return a.names == b.names and a.types == b.types


def schema_difference(first: pa.Schema, other: pa.Schema, label: str) -> str:
    missing = [n for n in first.names if n not in other.names]
    if label in missing:
        return f"no label column {label!r}"
    if missing:
        return "no column " + ", ".join(repr(n) for n in missing[:3])
    extra = [n for n in other.names if n not in first.names]
    if extra:
        return "an extra column " + ", ".join(repr(n) for n in extra[:3])
    for fld in first:
        if other.field(fld.name).type != fld.type:
            return f"{fld.name!r} is {other.field(fld.name).type}, not {fld.type}"
    return "its columns are in another order"


def is_numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def feature_columns(names: list[str] | tuple[str, ...], label: str,
                    chosen: list[str] | None, where: str) -> tuple[str, ...]:
    """data.columns, each checked to be there; null: every column but the label."""
    if chosen is None:
        return tuple(n for n in names if n != label)
    missing = [c for c in chosen if c not in names]
    if missing:
        raise ConfigError(f"data.columns: {missing[0]!r} is not a column of {where}: columns are "
                          + ", ".join(names))
    return tuple(chosen)


def check_numeric(schema: pa.Schema, label: str, key: str, path: str,
                  chosen: list[str] | None = None) -> None:
    for name in feature_columns(schema.names, label, chosen, path):
        if not is_numeric(schema.field(name).type):
            raise ConfigError(f"{key}={path!r}: feature column {name!r} is "
                              f"{schema.field(name).type}, only numeric feature columns are "
                              "allowed (data.columns chooses the features)")
