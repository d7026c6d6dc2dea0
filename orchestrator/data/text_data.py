"""CSV, TSV and JSON lines as data=parquet: converted once, on the driver, to a parquet dataset
beside the runs (``<storage.uri>/_data/<name>-<digest>``), keyed by the SHA-256 of the source
files (orchestrator/data/fingerprint.py), so every later command over the same files reads the
converted copy and nothing else; a changed file makes a new copy. Every node reads the copy
where it reads checkpoints (on a cluster, storage every node sees), and from there the data is
parquet: the same checks, held or streamed, each worker reading only its share.

The data's identity stays the source's: the run's name and the change check are made from
data.path as the user gave it (data.source keeps it)."""

from __future__ import annotations

import hashlib
import json
import os
import re

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from orchestrator.data.fingerprint import data_fingerprint
from orchestrator.data.manifest import TEXT_SUFFIXES, list_files
from orchestrator.errors import ConfigError, one_line
from orchestrator.storage.location import StorageSpec, join

DONE = "_converted.json"  # written last: a copy without it is converted again
ROWS_PER_GROUP = 65536


def text_kind(path: str) -> str | None:
    """csv, tsv or json (JSON lines) by the file's name; None for anything else."""
    name = re.sub(r"\.(gz|bz2)$", "", path.lower())
    for suffix, kind in ((".csv", "csv"), (".tsv", "tsv"), (".jsonl", "json"),
                         (".ndjson", "json"), (".json", "json")):
        if name.endswith(suffix):
            return kind
    return None


def source_files(spec: StorageSpec, key: str) -> tuple[str, list[pafs.FileInfo]] | None:
    """(kind, files) where ``spec`` names CSV, TSV or JSON lines files; None for parquet."""
    fs, path = spec.filesystem()
    infos = list_files(fs, path, key)
    kinds = {text_kind(i.path) for i in infos}
    if kinds == {None}:
        return None
    if len(kinds) > 1:
        shown = ", ".join(sorted(k or "parquet" for k in kinds))
        raise ConfigError(f"{key}={spec.uri!r}: its files mix formats ({shown}): one format per "
                          "path (a glob can choose: data/*.csv)")
    return kinds.pop(), infos


def converted(source: StorageSpec, storage: StorageSpec, label: str, key: str) -> str | None:
    """The parquet copy of ``source``'s CSV or JSON lines files (made where missing), or None
    where ``source`` is parquet already."""
    found = source_files(source, key)
    if found is None:
        return None
    kind, infos = found
    digests = data_fingerprint(source, infos, key)
    tag = hashlib.sha256(json.dumps(sorted(digests.values())).encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(source.uri.rstrip("/*")))
    stem = re.sub(r"\.(csv|tsv|jsonl|ndjson|json)(\.gz|\.bz2)?$", "", stem, flags=re.I) or "data"
    target = storage.child("_data", f"{stem}-{tag}")
    fs, folder = target.filesystem()
    if fs.get_file_info(join(folder, DONE)).type == pafs.FileType.File:
        return target.uri
    src_fs, _ = source.filesystem()
    fs.create_dir(folder, recursive=True)
    schema, rows = None, 0
    for index, info in enumerate(infos):
        try:
            table = read_text(src_fs, info.path, kind)
        except (pa.ArrowInvalid, OSError) as exc:
            raise ConfigError(f"{key}={source.uri!r}: {info.path} is not readable as "
                              f"{'JSON lines' if kind == 'json' else kind.upper()} "
                              f"({one_line(exc)[:200]})") from None
        schema = schema or numeric_features_as_float(table.schema, label)
        try:
            table = table.select(schema.names).cast(schema)
        except (KeyError, pa.ArrowInvalid, ValueError) as exc:
            raise ConfigError(f"{key}={source.uri!r}: {info.path} has other columns or types "
                              f"than {infos[0].path} ({one_line(exc)[:160]}); every file must "
                              "have the same columns") from None
        rows += table.num_rows
        write_parquet(fs, join(folder, f"part-{index:05d}.parquet"), table)
    record = {"source": source.uri, "files": digests, "rows": rows}
    with fs.open_output_stream(join(folder, DONE)) as f:
        f.write(json.dumps(record, sort_keys=True).encode())
    return target.uri


def read_text(fs: pafs.FileSystem, path: str, kind: str) -> pa.Table:
    import pyarrow.csv as pacsv
    import pyarrow.json as pajson

    compression = "gzip" if path.endswith(".gz") else "bz2" if path.endswith(".bz2") else None
    with fs.open_input_stream(path, compression=compression) as f:
        if kind == "json":
            return pajson.read_json(f)
        return pacsv.read_csv(f, parse_options=pacsv.ParseOptions(
            delimiter="\t" if kind == "tsv" else ","))


def numeric_features_as_float(schema: pa.Schema, label: str) -> pa.Schema:
    """The first file's columns, integer features as float64: a later file (or row) with a
    fraction in a column read as integers is the same column."""
    return pa.schema([pa.field(f.name, pa.float64()) if f.name != label
                      and pa.types.is_integer(f.type) else f for f in schema])


def write_parquet(fs: pafs.FileSystem, path: str, table: pa.Table) -> None:
    """Whole or not at all under ``path`` (a local file is renamed into place)."""
    local = isinstance(fs, pafs.LocalFileSystem)
    tmp = f"{path}.tmp{os.getpid()}" if local else path
    with fs.open_output_stream(tmp) as sink:
        pq.write_table(table, sink, row_group_size=ROWS_PER_GROUP)
    if local:
        fs.move(tmp, path)


__all__ = ["TEXT_SUFFIXES", "converted", "source_files", "text_kind"]
