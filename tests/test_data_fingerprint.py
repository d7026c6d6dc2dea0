"""The data's content digests (orchestrator/data/fingerprint.py) and the decisions a rerun of a
finished run makes (orchestrator/driver/run_plan.py), without Ray."""

from __future__ import annotations

import os
import time

import pyarrow.fs as pafs
import pytest

from orchestrator.data.fingerprint import data_fingerprint, what_changed
from orchestrator.driver.run_plan import derive_run_name, flat, longer, run_identity
from orchestrator.storage.location import StorageSpec


def digests(folder, monkeypatch, tmp_path) -> dict:
    monkeypatch.setenv("ORCHESTRATOR_PRIVATE_DIR", str(tmp_path / "private"))
    fs = pafs.LocalFileSystem()
    infos = fs.get_file_info(pafs.FileSelector(str(folder)))
    return data_fingerprint(StorageSpec(str(folder)), sorted(infos, key=lambda i: i.path),
                            "data.path")


def test_content_decides_not_sizes_or_times(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.parquet").write_bytes(b"0" * 1000)
    (data / "b.parquet").write_bytes(b"1" * 10)
    cache = tmp_path / "private" / "data-digests"
    digests(data, monkeypatch, tmp_path)
    assert not list(cache.iterdir())  # written this instant: not cached (racy)
    past = time.time_ns() - 10**10
    for name in ("a.parquet", "b.parquet"):
        os.utime(data / name, ns=(past, past))
    before = digests(data, monkeypatch, tmp_path)
    assert len(list(cache.iterdir())) == 2  # cached

    # A copy with new times is the same data; the same size with other bytes is not, even
    # with the modification time put back (the change time tells the cache).
    stat = os.stat(data / "a.parquet")
    (data / "a.parquet").write_bytes(b"0" * 1000)
    assert what_changed(before, digests(data, monkeypatch, tmp_path)) is None
    (data / "a.parquet").write_bytes(b"9" + b"0" * 999)
    os.utime(data / "a.parquet", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    (data / "c.parquet").write_bytes(b"new")
    (data / "b.parquet").unlink()
    now = digests(data, monkeypatch, tmp_path)
    assert what_changed(before, now) == (
        f"1 file rewritten ({data / 'a.parquet'}), 1 file added ({data / 'c.parquet'}), "
        f"1 file removed ({data / 'b.parquet'})")


def test_how_long_a_run_trains_is_not_what_it_is():
    trainer = {"name": "ddp", "lr": 0.1, "epochs": 10, "max_steps": None, "model": {"h": [8]}}
    data = {"name": "digits", "on_change": "refuse"}
    longer_run = {**trainer, "epochs": 20, "max_steps": 500}
    assert derive_run_name(trainer, data, 0) == derive_run_name(longer_run, data, 0)
    assert derive_run_name(trainer, data, 0) != derive_run_name({**trainer, "lr": 0.2}, data, 0)
    # The model's layout over the workers is not what the run trains, as the cluster's size
    laid_out = {**trainer, "pipeline": {"degree": 2}, "tensor": {"degree": 2}}
    assert derive_run_name(trainer, data, 0) == derive_run_name(laid_out, data, 0)
    assert flat(run_identity(trainer, {**data, "on_change": "restart"}, 0)) == {
        "trainer.name": "ddp", "trainer.lr": 0.1, "trainer.model.h": [8], "data.name": "digits",
        "seed": 0}


@pytest.mark.parametrize("then, now, more", [
    (10, 10, False), (10, 20, True), (10, 5, False), (500, None, True), (None, 500, False),
    (None, None, False)])
def test_a_length_key_asks_for_more(then, now, more):
    assert longer(then, now) is more


def test_json_lines_and_tsv_become_parquet_once_with_one_schema(tmp_path, monkeypatch):
    """A JSON lines file whose first rows hold whole numbers and later ones fractions, and a
    TSV beside it: one parquet copy each, integer features read as floats; the same files
    again take the copy made before; mixed formats in one path are one line."""
    import pyarrow.parquet as pq

    from orchestrator.data.text_data import DONE, converted
    from orchestrator.errors import ConfigError

    monkeypatch.setenv("ORCHESTRATOR_PRIVATE_DIR", str(tmp_path / "private"))
    storage = StorageSpec(str(tmp_path / "ckpt"))
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text('{"x": 1, "label": 0}\n{"x": 2, "label": 1}\n')
    (data / "b.jsonl").write_text('{"x": 2.5, "label": 1}\n')
    copy = converted(StorageSpec(str(data)), storage, "label", "data.path")
    assert copy.startswith(str(tmp_path / "ckpt" / "_data" / "data-"))
    table = pq.read_table(copy)
    assert table.column("x").to_pylist() == [1.0, 2.0, 2.5] and table.num_rows == 3
    assert str(table.schema.field("label").type) == "int64"
    done = os.stat(os.path.join(copy, DONE)).st_mtime_ns
    assert converted(StorageSpec(str(data)), storage, "label", "data.path") == copy
    assert os.stat(os.path.join(copy, DONE)).st_mtime_ns == done  # not converted again

    (tmp_path / "t.tsv").write_text("x\tlabel\n1\t0\n")
    assert pq.read_table(converted(StorageSpec(str(tmp_path / "t.tsv")), storage, "label",
                                   "data.path")).num_rows == 1
    with pytest.raises(ConfigError, match=r"data.path=.*/mixed\*': its files mix formats "
                                          r"\(csv, json\): one format per path"):
        (tmp_path / "mixed.csv").write_text("x,label\n1,0\n")
        (tmp_path / "mixed.jsonl").write_text('{"x": 1, "label": 0}\n')
        converted(StorageSpec(str(tmp_path / "mixed*")), storage, "label", "data.path")
