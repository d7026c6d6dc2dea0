"""Streamed parquet (orchestrator/data/stream_*.py) without Ray: the order's guarantees, and
that the rows a rank reads are the rows the order names."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from orchestrator.config.schema import DataConfig
from orchestrator.data.manifest import read_manifest, what_changed
from orchestrator.data.streaming import plan_stream
from orchestrator.errors import ConfigError
from orchestrator.storage.location import StorageSpec

FEATURES = 3


def write_data(folder, files=4, groups=3, rows=50, label=None):
    """Rows whose first feature is their global id (files in name order)."""
    folder.mkdir(parents=True, exist_ok=True)
    first = 0
    for f in range(files):
        n = groups * rows
        ids = np.arange(first, first + n)
        table = pa.table({"id": ids.astype(np.float64),
                          **{f"f{i}": np.sin(ids * (i + 1)).astype(np.float32) for i in range(1, FEATURES)},
                          "label": (ids % 3) if label is None else label(ids)})
        pq.write_table(table, folder / f"part-{f:02d}.parquet", row_group_size=rows)
        first += n
    return folder


def config(path, **kw):
    return DataConfig(name="parquet", path=str(path), **{"stream": "true", **kw})


def stream_plan(path, workers=4, batch=16, resumed=None, **kw):
    return plan_stream(config(path, **kw), StorageSpec(str(path)), seed=7, trainer=None,
                       workers=workers, global_batch=batch, task="classification", resumed=resumed)


def read_ids(plan, order, rank, world, start, total):
    """The ids a rank's stream gives, from the data itself (feature 'id', unscaled)."""
    stream = plan.rank_stream(order, rank, world)
    out = []
    mean, std = plan.decoding.mean[0], plan.decoding.std[0]
    for ids, x, _ in stream.steps(start, total):
        assert np.array_equal(np.rint(x[:, 0] * std + mean).astype(np.int64), ids)
        out.append(ids)
    return out, stream.reader.bytes_read


def test_the_global_batch_is_the_same_at_every_world_size_and_each_rank_reads_its_share(tmp_path):
    data = write_data(tmp_path / "data")
    plan = stream_plan(data)
    order = plan.order(16)
    total = order.steps_per_epoch * 2 + 3  # over an epoch boundary
    steps = {}
    for world in (1, 2, 3, 4):  # 3: ranks stream 2, 1 and 1 of the 4 shards
        ranks = [read_ids(plan, plan.order(16), r, world, 0, total) for r in range(world)]
        steps[world] = [np.sort(np.concatenate([ranks[r][0][s] for r in range(world)]))
                        for s in range(total)]
        if world == 4:  # each rank read about a quarter of the bytes of an epoch (x2 epochs)
            size = sum(f.size for f in plan.manifest.files)
            for _, read in ranks:
                assert read <= 1.25 * 2 * size / 4 + 64 * 1024
    for s in range(total):
        assert all(np.array_equal(steps[1][s], steps[w][s]) for w in (2, 3, 4))
        assert np.array_equal(steps[1][s], np.sort(order.global_batch_rows(s)))
        assert len(steps[1][s]) == 16
    epoch = np.concatenate(steps[1][:order.steps_per_epoch])
    assert len(np.unique(epoch)) == len(epoch)  # no row twice in an epoch
    assert not np.array_equal(steps[1][0], steps[1][order.steps_per_epoch])  # reshuffled


def test_a_resume_mid_epoch_at_another_size_continues_exactly(tmp_path):
    data = write_data(tmp_path / "data")
    plan = stream_plan(data)
    order = plan.order(16)
    total = order.steps_per_epoch + 4
    whole, _ = read_ids(plan, order, 0, 1, 0, total)
    middle = order.steps_per_epoch - 2
    resumed = [read_ids(plan, plan.order(16), r, 2, middle, total)[0] for r in range(2)]
    for i, s in enumerate(range(middle, total)):
        assert np.array_equal(np.sort(whole[s]), np.sort(np.concatenate([r[i] for r in resumed])))


def test_held_out_rows_never_train_and_every_row_is_somewhere(tmp_path):
    data = write_data(tmp_path / "data", files=2)
    plan = stream_plan(data, workers=2)
    order = plan.order(8)
    trained = np.concatenate([order.train_ids(g) for g in range(len(plan.manifest.groups))])
    tested = []
    for rank in range(2):
        for x, _y, weight in plan.eval_share(order, rank, 2, 10):
            if weight:
                tested.append(np.rint(x[:, 0] * plan.decoding.std[0] + plan.decoding.mean[0]))
    tested = np.concatenate(tested).astype(np.int64)
    assert len(np.intersect1d(trained, tested)) == 0
    assert len(trained) + len(tested) == plan.manifest.rows
    assert 0.1 < len(tested) / plan.manifest.rows < 0.3  # data.test_fraction 0.2


def test_held_out_data_of_fewer_row_groups_than_ranks_pads_the_others(tmp_path):
    """data.eval_path of one row group at 2 ranks: rank 1 has no held-out row of its own and
    yields as many batches as rank 0, each a real row weighing nothing (it crashed)."""
    data, held = write_data(tmp_path / "data", files=2), write_data(tmp_path / "eval", files=1,
                                                                      groups=1)
    plan = stream_plan(data, workers=2, eval_path=str(held))
    order = plan.order(8)
    shares = [list(plan.eval_share(order, rank, 2, 16)) for rank in range(2)]
    assert len(shares[0]) == len(shares[1]) == 4  # 50 rows in batches of 16
    assert sum(len(x) for x, _, w in shares[0] if w) == 50
    assert all(w == 0.0 and len(x) == 1 for x, _, w in shares[1])


def test_changed_data_is_named_and_refused_unless_asked(tmp_path):
    data = write_data(tmp_path / "data")
    before = stream_plan(data).order(16).position()
    write_data(tmp_path / "data", files=5)  # one file more
    with pytest.raises(ConfigError, match=r"changed since .*1 file added \(.*part-04.parquet\).*"
                                          r"data.on_change=continue"):
        stream_plan(data, resumed=before)
    assert stream_plan(data, resumed=before, on_change="continue").shards == 4
    # A resume keeps the checkpoint's shards: more workers than those is refused with a way out.
    with pytest.raises(ConfigError, match=r"the checkpoint's shard count=4 is fewer than "
                                          r"cluster.workers=5: .*cluster.workers<=4, or start a "
                                          r"new run \(run.name\)"):
        stream_plan(data, workers=5, resumed=before, on_change="continue")
    now = read_manifest(pafs.LocalFileSystem(), str(data), "label")
    assert what_changed(now.summary(), now) is None
    # a checkpoint of an older version digested other fields: the same files are the same data
    assert what_changed({**now.summary(), "digest": "0123456789abcdef"}, now) is None


@pytest.mark.parametrize("pattern, parts", [
    ("{folder}", [0, 1, 2, 3]), ("{folder}/part-*.parquet", [0, 1, 2, 3]),
    ("{folder}/part-0[13].parquet", [1, 3]), ("{folder}/part-0?.parquet", [0, 1, 2, 3])])
def test_every_reader_sees_the_files_the_stream_reads(tmp_path, pattern, parts):
    """A glob (brackets too) and a folder holding other files (Spark's _SUCCESS and .crc
    files, a README): the driver's check, the in-memory read and the stream's manifest take
    the same parquet files (the check used to open the path as it was: a glob was 'no parquet
    data there', and so was a folder with a README)."""
    from orchestrator.data.datasets import check_parquet, read_parquet

    folder = write_data(tmp_path / "data")
    for other in ("_SUCCESS", ".part-00.parquet.crc", "README.txt"):
        (folder / other).write_text("not parquet")
    path = pattern.format(folder=folder)
    files = [str(folder / f"part-{p:02d}.parquet") for p in parts]
    assert sorted(check_parquet(config(path)).files) == files
    x, _, names, _, _ = read_parquet(config(path), None)
    assert names[0] == "id" and sorted(x[:, 0].astype(int)) == [
        i for p in parts for i in range(p * 150, p * 150 + 150)]
    assert [f.path for f in stream_plan(path).manifest.files] == files


@pytest.mark.parametrize("case, message", [
    ("empty", r"data.path=.*: no parquet files there"),
    ("schema", r"part-01.parquet has another schema than .*part-00.parquet \('f1' is double"),
    ("label", r"part-01.parquet has another schema .*\(no label column 'label'\)"),
    ("big_group", r"data.max_row_group_mb=0.001: row group 0 of .* holds"),
    ("text", r"feature column 'f1' is string, only numeric"),
    ("few_groups", r"has 2 row groups, fewer than 4 virtual shards"),
    ("small_batch", r"trainer.batch_size=2 is smaller than the 4 virtual shards"),
])
def test_bad_data_is_one_line_from_the_footers(tmp_path, case, message):
    data = tmp_path / "data"
    kw, batch = {}, 16
    if case == "empty":
        data.mkdir()
    elif case in ("schema", "label", "text"):
        write_data(data, files=1)
        table = pq.read_table(data / "part-00.parquet")
        if case == "schema":
            table = table.set_column(1, "f1", table["f1"].cast(pa.float64()))
        elif case == "label":
            table = table.drop_columns(["label"])
        else:
            table = table.set_column(1, "f1", pa.array([str(v) for v in table["f1"].to_pylist()]))
        pq.write_table(table, data / ("part-01.parquet" if case != "text" else "part-00.parquet"))
    elif case == "big_group":
        write_data(data, files=1)
        kw["max_row_group_mb"] = 0.001
    elif case == "few_groups":
        write_data(data, files=1, groups=2)
    else:
        write_data(data)
        batch = 2
    with pytest.raises(ConfigError, match=message):
        stream_plan(data, batch=batch, **kw)
    if case in ("schema", "label"):  # held in memory: the driver's check says the same (it
        from orchestrator.data.datasets import check_parquet  # read the first file's columns)

        with pytest.raises(ConfigError, match=message):
            check_parquet(config(data))


def test_files_alike_but_for_a_columns_nullability_pass_and_no_rows_is_one_line(tmp_path):
    """A column declared non-null in one file and nullable in another is the same column (its
    nulls are counted by the finite check); data without rows says so, naming data.path (it
    failed as an out-of-bounds target in the trial step)."""
    from orchestrator.data.datasets import check_parquet, data_facts

    data = write_data(tmp_path / "data", files=1)
    table = pq.read_table(data / "part-00.parquet")
    strict = pa.schema([f.with_nullable(False) for f in table.schema])
    pq.write_table(table.cast(strict), data / "part-01.parquet")
    assert len(check_parquet(config(data)).files) == 2
    assert stream_plan(data).manifest.rows == 2 * table.num_rows
    (tmp_path / "none").mkdir()
    pq.write_table(table.slice(0, 0), tmp_path / "none" / "part-00.parquet")
    with pytest.raises(ConfigError, match=r"^data.path='.*none': 0 rows; training needs 2 or more$"):
        data_facts(config(tmp_path / "none"))


@pytest.mark.parametrize("rows, columns", [(131, 7), (4096, 64), (3, 2)])
def test_the_compiled_decode_gives_numpys_bits(rows, columns):
    """Rows from columns (orchestrator/data/_rows.c, built by `make install`) against numpy's
    blocks: the same bits for float32, float64 and integer columns with nulls, NaN and
    infinities, scaled and not, and row and column counts that leave tails."""
    from orchestrator.data import stream_reader

    assert stream_reader.rows_from_columns is not None, "the compiled decode was not built"
    rng = np.random.default_rng(rows)
    data = {}
    for c in range(columns):
        values = rng.standard_normal(rows) * 10.0 ** rng.integers(-3, 6)
        kind = c % 3
        if kind == 0:
            data[f"c{c}"] = pa.array(values.astype(np.float32))
        elif kind == 1:
            values[rng.integers(0, rows, 3)] = [np.nan, np.inf, -np.inf]
            data[f"c{c}"] = pa.array(values, mask=rng.random(rows) < 0.1)
        else:
            data[f"c{c}"] = pa.array(values.astype(np.int64), mask=rng.random(rows) < 0.1)
    table = pa.table(data)
    names = list(data)
    mean = rng.standard_normal(columns).astype(np.float32)
    std = (rng.random(columns) + 0.1).astype(np.float32)
    for scale in [(mean, std), (None, None)]:
        compiled = stream_reader.row_major(table, names, *scale)
        expected = np.empty_like(compiled)
        stream_reader.fill_rows([table[n].to_numpy(zero_copy_only=False) for n in names],
                                expected, *scale)
        assert compiled.flags.c_contiguous and compiled.dtype == np.float32
        assert np.array_equal(compiled.view(np.uint32), expected.view(np.uint32))
        parts = [table.slice(0, rows // 3), table.slice(rows // 3)]  # a window's row groups
        assert np.array_equal(stream_reader.row_major(parts, names, *scale).view(np.uint32),
                              expected.view(np.uint32))
        # the window's shuffle of its training rows, written where each row goes
        picked = rng.permutation(rows)[: max(1, rows * 2 // 3)]
        shuffled = stream_reader.row_major(parts, names, *scale, rows=picked)
        assert np.array_equal(shuffled.view(np.uint32), expected[picked].view(np.uint32))
        compiled_path = stream_reader.rows_from_columns
        try:  # numpy's path gives the same rows
            stream_reader.rows_from_columns = None
            again = stream_reader.row_major(parts, names, *scale, rows=picked)
        finally:
            stream_reader.rows_from_columns = compiled_path
        assert np.array_equal(again.view(np.uint32), shuffled.view(np.uint32))
    if columns % 4 == 0:  # shuffled rows into an `out` whose rows are not 16-byte aligned
        floats = [table[n].to_numpy(zero_copy_only=False).astype(np.float32) for n in names]
        dest = np.full(rows, -1, dtype=np.int64)
        dest[picked] = np.arange(len(picked))
        unaligned = np.empty(len(picked) * columns + 1, np.float32)[1:].reshape(len(picked), columns)
        stream_reader.rows_from_columns(floats, unaligned, mean, std, dest)
        assert np.array_equal(unaligned.view(np.uint32),
                              stream_reader.row_major(table, names, mean, std, picked).view(np.uint32))
    with pytest.raises(TypeError, match="float32"):
        stream_reader.rows_from_columns([np.zeros(3)], np.zeros((3, 1), np.float32), None, None)
    with pytest.raises(ValueError, match="past the end"):  # never a write outside `out`
        stream_reader.rows_from_columns([np.zeros(3, np.float32)], np.zeros((2, 1), np.float32),
                                        None, None, np.array([0, 2, -1]))
    with pytest.raises(ValueError, match="different lengths"):
        stream_reader.rows_from_columns([np.zeros(3, np.float32), np.zeros(2, np.float32)],
                                        np.zeros((3, 2), np.float32), None, None)


def test_labels_become_class_indices_whatever_their_values():
    """Labels that are already 0..k-1 are taken as they are; others become their place among
    the sorted classes; strings too."""
    from orchestrator.data.stream_reader import Decoding

    table = pa.table({"f": pa.array([0.5, 1.5, 2.5, 3.5], pa.float32()), "y": [2, 0, 1, 2]})
    rows = np.array([3, 0, 2])
    for classes in [(0, 1, 2), (0, 1, 2, 3)]:  # indices already
        x, y = Decoding(("f",), "y", classes, None, None).decode(table, rows)
        assert y.dtype == np.int64 and y.tolist() == [2, 2, 1]
        assert x[:, 0].tolist() == [3.5, 0.5, 2.5]
    gaps = pa.table({"f": table["f"], "y": [2, 0, 0, 2]})  # classes 0 and 2: places 0 and 1
    y = Decoding(("f",), "y", (0, 2), None, None).decode(gaps, rows)[1]
    assert y.dtype == np.int64 and y.tolist() == [1, 1, 0]
    strings = pa.table({"f": pa.array([1.0, 2.0], pa.float32()), "y": ["b", "a"]})
    assert Decoding(("f",), "y", ("a", "b"), None, None).decode(strings)[1].tolist() == [1, 0]


def test_the_compiled_split_gives_numpys_rows():
    """The held-out hash compiled (orchestrator/data/_rows.c) against numpy's passes: the same
    rows for ids, seeds and fractions of every kind, so a run's split does not depend on
    whether the install had a C compiler."""
    from orchestrator.data import row_split

    assert row_split.compiled_held_out is not None, "the compiled split was not built"
    rng = np.random.default_rng(7)
    cases = [(np.arange(4096, dtype=np.int64) + 2**40, 0, 0.2), (np.array([], np.int64), 3, 0.5),
             (rng.integers(-2**40, 2**62, 5000), -12345, 0.37), (np.arange(100), 2**63 - 1, 0.0),
             (np.arange(100, dtype=np.int32), 9, 1.0)]
    for ids, seed, fraction in cases:
        compiled = row_split.held_out(ids, seed, fraction)
        saved, row_split.compiled_held_out = row_split.compiled_held_out, None
        try:
            expected = row_split.held_out(ids, seed, fraction)
        finally:
            row_split.compiled_held_out = saved
        assert compiled.dtype == bool and np.array_equal(compiled, expected)
    assert 0.15 < row_split.held_out(np.arange(100_000), 0, 0.2).mean() < 0.25


def test_a_user_folders_odd_files_and_uneven_row_groups_are_one_line_or_said(tmp_path, caplog):
    """Found by trying it as a user: a glob took a sub-folder's files too; an unreadable file
    after the first was a traceback; null labels and eval labels the training data lacks were
    a crash and silent mislabels; row groups dealt unevenly trained 0 steps an epoch, exit 0."""
    from orchestrator.data.datasets import check_parquet

    data = write_data(tmp_path / "data", files=2)
    write_data(tmp_path / "data" / "holdout", files=1)  # not data/*.parquet, as in a shell
    hidden = tmp_path / "data" / ".part-09.parquet"
    hidden.write_bytes((data / "part-00.parquet").read_bytes())
    assert [f.path for f in stream_plan(f"{data}/*.parquet").manifest.files] == \
        [str(data / "part-00.parquet"), str(data / "part-01.parquet")]
    assert len(stream_plan(f"{data}/**/*.parquet").manifest.files) == 3

    (data / "part-02.parquet").write_bytes(b"")  # an interrupted copy
    for check in (lambda: check_parquet(config(data)), lambda: stream_plan(data)):
        with pytest.raises(ConfigError, match=r"part-02.parquet is not a readable parquet file"):
            check()
    (data / "part-02.parquet").unlink()

    labels = tmp_path / "unlabelled"
    write_data(labels, files=1, label=lambda ids: pa.array([None if i == 7 else i % 3 for i in ids]))
    with pytest.raises(ConfigError, match=r"1 rows have no label \(data.label='label' is null"):
        stream_plan(labels)

    other = write_data(tmp_path / "eval", files=1, label=lambda ids: ids % 4)  # a class 3
    with pytest.raises(ConfigError, match=r"^data.eval_path=.*: label values that data.path does "
                                          r"not have \(3\)"):
        stream_plan(data, eval_path=str(other))

    uneven = write_data(tmp_path / "uneven", files=1, groups=3, rows=50)
    pq.write_table(pq.read_table(uneven / "part-00.parquet").slice(0, 3),
                   uneven / "part-01.parquet")  # one row group of 3 rows: a shard of its own
    with pytest.raises(ConfigError, match=r"give shard 3 [0-3] training rows, fewer than the 4 it "
                                          r"gives each global batch .*not one step an epoch"):
        stream_plan(uneven, batch=16)
    caplog.clear()
    assert stream_plan(uneven, workers=2, batch=4).shards == 2  # 2 shards: 100 and 53 rows
    assert "of the training rows out of each epoch" in caplog.text


def test_data_columns_chooses_the_features_streamed_or_held_in_memory(tmp_path):
    """A user's parquet with an id, a timestamp and a text column beside the features: the
    command refused it ('feature column ... is string'); data.columns chooses what trains."""
    from orchestrator.data.datasets import check_parquet, data_facts, read_parquet
    from orchestrator.data.nonfinite import check_finite

    data = write_data(tmp_path / "data", files=2)
    for path in sorted(data.glob("*.parquet")):
        table = pq.read_table(path)
        n = table.num_rows
        table = table.append_column("city", pa.array(["x"] * n)).append_column(
            "seen", pa.array(np.arange(n).astype("datetime64[s]"))).append_column(
            "f9", pa.array([np.nan] * n))  # a column of NaN, left out too
        pq.write_table(table, path, row_group_size=50)
    with pytest.raises(ConfigError, match=r"feature column 'city' is string, only numeric feature "
                                          r"columns are allowed \(data.columns chooses"):
        check_parquet(config(data))
    chosen = config(data, columns=["f2", "id"])
    check_finite(chosen, check_parquet(chosen))  # f9's NaN are not a feature's
    assert data_facts(chosen).features == 2
    x, _, names, _, _ = read_parquet(chosen, None)
    assert names == ["f2", "id"] and x.shape[1] == 2
    plan = stream_plan(data, columns=["f2", "id"])
    assert plan.decoding.features == ("f2", "id")
    order = plan.order(16)
    ids, x, _ = next(iter(plan.rank_stream(order, 0, 1).steps(0, 1)))
    assert x.shape == (16, 2) and np.array_equal(
        np.rint(x[:, 1] * plan.decoding.std[1] + plan.decoding.mean[1]).astype(np.int64), ids)
    with pytest.raises(ConfigError, match=r"^data.columns: 'nope' is not a column of .*: columns are id"):
        stream_plan(data, columns=["nope"])
    for bad in (["label"], [], ["f1", "f1"]):
        with pytest.raises(ConfigError, match=r"^data.columns="):
            config(data, columns=bad)


def test_a_text_label_streams(tmp_path):
    """The driver sampled a few row groups for the feature scaling with the label read as a
    number: text labels ('yes', 'no') stopped a streamed command with a traceback."""
    data = write_data(tmp_path / "data", label=lambda ids: pa.array(np.where(ids % 2, "yes", "no")))
    plan = stream_plan(data)
    assert plan.decoding.classes == ("no", "yes")
    ids, _, y = next(iter(plan.rank_stream(plan.order(16), 0, 1).steps(0, 1)))
    assert np.array_equal(y, ids % 2)


@pytest.mark.parametrize("label", [lambda ids: (ids % 3 == 0).astype(np.int64), None])
def test_streamed_lightgbm_goes_on_from_a_saved_model_as_if_it_had_not_stopped(tmp_path, label):
    """lgb.train(init_model=...) over row-group data refused ("Cannot set predictor after freed
    raw data"): every restart of a streamed LightGBM run failed. The train set the loop builds
    for a resume takes the saved model's scores: 3 + 3 rounds make the 6-round model."""
    import dataclasses

    import lightgbm as lgb

    from orchestrator.data.streaming import DataShare
    from trainers.lightgbm.config import LightGBMConfig
    from trainers.lightgbm.loop import Streamed, booster_params

    class OneRank:
        def __init__(self, share):
            self._share = share

        def share(self):
            return self._share

    plan = plan_stream(config(write_data(tmp_path / "d", files=2, label=label)),
                       StorageSpec(str(tmp_path)), seed=7, trainer=None, workers=1,
                       global_batch=None, task="classification", resumed=None)
    data = Streamed(OneRank(DataShare(plan, 0, 1)))
    params = booster_params(dataclasses.asdict(LightGBMConfig()), data.num_classes, 0) | \
        {"num_threads": 1, "deterministic": True}
    whole = lgb.train(params, data.train_set(params), num_boost_round=6)
    first = lgb.train(params, data.train_set(params), num_boost_round=3)
    first.save_model(str(tmp_path / "model.txt"))
    saved = lgb.Booster(model_file=str(tmp_path / "model.txt"))
    resumed = lgb.train(params, data.train_set(params, saved), num_boost_round=3, init_model=saved)
    x, _ = next(iter(data.share.test_chunks()))
    assert resumed.current_iteration() == 6
    assert np.array_equal(resumed.predict(x), whole.predict(x))


def test_what_a_user_would_break_the_memory_bound_the_hidden_folders_nan_and_uneven_shares(
        tmp_path):
    """Found by a review trying it as a user: the memory a row group takes decoded came from the
    footer's encoded size (dictionary-encoded doubles: ~1/27 of it), counted columns never
    read; `**` took a dot-folder's copies; one NaN in the sampled rows made a feature NaN in
    every row; with 4 shards on 3 ranks a rank's forward passed trainer.micro_batch_size."""
    data = tmp_path / "flags"
    data.mkdir()
    n = 200_000
    flags = np.arange(n) % 8  # low-cardinality doubles: parquet stores them as a dictionary
    pq.write_table(pa.table({"f1": flags.astype(np.float64), "f2": flags.astype(np.float64),
                             "note": pa.array(["x" * 40] * n), "label": flags % 2}), data / "a.parquet")
    footer = pq.ParquetFile(data / "a.parquet").metadata.row_group(0).total_byte_size
    manifest = read_manifest(pafs.LocalFileSystem(), str(data), "label", chosen=["f1", "f2"])
    assert manifest.memory >= n * (8 + 8 + 8) > 5 * footer  # f1, f2, label; not the text
    with pytest.raises(ConfigError, match=r"data.max_row_group_mb=2: row group 0 of .* holds 4.58 "
                                          r"MiB decoded"):
        read_manifest(pafs.LocalFileSystem(), str(data), "label", max_row_group_mb=2,
                      chosen=["f1", "f2"])

    folder = write_data(tmp_path / "data", files=2)
    hidden = folder / ".ipynb_checkpoints"
    hidden.mkdir()
    (hidden / "part-00-checkpoint.parquet").write_bytes((folder / "part-00.parquet").read_bytes())
    assert [f.path for f in stream_plan(f"{folder}/**/*.parquet").manifest.files] == \
        [str(folder / "part-00.parquet"), str(folder / "part-01.parquet")]

    nan = write_data(tmp_path / "nan", files=1)
    table = pq.read_table(nan / "part-00.parquet")
    f1 = table["f1"].to_numpy().copy()
    f1[0] = np.nan
    pq.write_table(table.set_column(1, "f1", pa.array(f1)), nan / "part-00.parquet",
                   row_group_size=50)
    plan = stream_plan(nan, workers=1, allow_nonfinite=True, test_fraction=0.01)
    assert np.isfinite(plan.decoding.mean).all() and np.isfinite(plan.decoding.std).all()
    _, x, _ = next(iter(plan.rank_stream(plan.order(16), 0, 1).steps(0, 1)))
    assert np.isfinite(x).sum() >= x.size - 1  # the NaN stays in its own row

    from orchestrator.worker_api import StreamedBatches
    from trainers.pytorch.data import StepPlan

    plan = stream_plan(write_data(tmp_path / "d4"), workers=4)  # 4 shards
    batches = [StreamedBatches(plan.order(64), plan, rank, 3, lambda _: None) for rank in range(3)]
    assert batches[0].largest_share == 32  # rank 0 streams shards 0 and 3
    for rank in range(3):
        micro = StepPlan(batches[rank], 3, micro_batch_size=8).micro_batches(0)
        assert len(micro) == 4 and max(len(m.rows) for m in micro) <= 8
        assert all(len(m.rows) >= 2 for m in micro)  # a padding one too (BatchNorm)


def test_a_resume_finds_changed_data_held_or_streamed_and_a_boosting_share_keeps_its_manifest(
        tmp_path):
    """Streamed XGBoost/LightGBM checkpoints kept no manifest, so a change went unnoticed;
    data.stream=auto over data that shrank below stream_above_mb resumed in memory, in another
    order, unrefused. A boosting share pins no shard count: a resume may use more workers."""
    from orchestrator.data.streaming import DataShare

    data = write_data(tmp_path / "data")
    streamed = stream_plan(data).order(16).position()
    share = DataShare(stream_plan(data, batch=None), 0, 1).position(5)
    assert share["manifest"] == streamed["manifest"] and "shards" not in share
    (data / "part-03.parquet").unlink()
    for before in (streamed, share):
        with pytest.raises(ConfigError, match=r"changed since .*1 file removed"):
            stream_plan(data, resumed=before, stream="auto")  # now far below 256 MiB
        # on_change=continue: the data as it is now decides, by its size (held: it is small)
        assert stream_plan(data, resumed=before, stream="auto", on_change="continue") is None
    # Unchanged, it resumes streamed as the checkpoint read it, however small the data is.
    assert stream_plan(data, resumed=stream_plan(data).order(16).position(), stream="auto")
    assert stream_plan(data, workers=6, batch=None, resumed=share, on_change="continue").shards == 6
    # A checkpoint that held its data in memory resumes in memory.
    held = {"seed": 7, "num_rows": 450, "global_batch": 16, "next_step": 3}
    assert stream_plan(data, resumed=held, stream="auto") is None


def test_held_out_files_need_only_the_columns_the_model_reads(tmp_path):
    data = write_data(tmp_path / "data", files=2)
    held = write_data(tmp_path / "eval", files=1)
    pq.write_table(pq.read_table(held / "part-00.parquet").drop_columns(["f2"]),
                   held / "part-00.parquet", row_group_size=50)
    plan = stream_plan(data, workers=2, eval_path=str(held), columns=["id", "f1"])
    assert plan.eval_manifest is not None
    with pytest.raises(ConfigError, match=r"data.eval_path=.*: it lacks columns the model reads "
                                          r"from data.path \(f2\)"):
        stream_plan(data, workers=2, eval_path=str(held))


def test_the_advised_on_change_resumes_the_same_run_and_held_out_files_inside_it_are_refused(
        tmp_path):
    """data.on_change=continue, as a refusal advises, named another run (the run name hashed
    it): it started over at step 0. A folder is read recursively: data.eval_path=events/holdout
    under data.path=events trained on the held-out rows."""
    from orchestrator.driver.run_plan import checked_data_facts, derive_run_name

    data = {"name": "parquet", "path": "events", "on_change": "refuse"}
    assert derive_run_name({"name": "ddp"}, data, 0) == \
        derive_run_name({"name": "ddp"}, {**data, "on_change": "continue"}, 0)
    assert derive_run_name({"name": "ddp"}, data, 0) != \
        derive_run_name({"name": "ddp"}, {**data, "path": "other"}, 0)
    events = write_data(tmp_path / "events", files=2)
    held = write_data(events / "holdout", files=1)
    with pytest.raises(ConfigError, match=r"^data.eval_path=.*: 1 of its files are data.path's too "
                                          r".*held-out rows would be trained on"):
        checked_data_facts(DataConfig(name="parquet", path=str(events), eval_path=str(held)),
                           StorageSpec(str(tmp_path)))
    facts = checked_data_facts(DataConfig(name="parquet", path=f"{events}/*.parquet",
                                          eval_path=str(held)), StorageSpec(str(tmp_path)))
    assert facts.features == FEATURES


def test_a_share_of_many_small_files_keeps_only_the_newest_footers(tmp_path):
    """Every file's footer stayed in memory for the whole run (~70 KiB a 64-column file)."""
    from orchestrator.data.stream_reader import GroupReader

    data = write_data(tmp_path / "many", files=70, groups=1, rows=4)
    plan = stream_plan(data, workers=1, batch=4)
    reader = GroupReader(plan.manifest, pafs.LocalFileSystem(), plan.decoding)
    for g in range(len(plan.manifest.groups)):
        x, _ = reader.read(g)
        assert len(x) == 4
    assert len(reader._footers) == GroupReader.FOOTERS_KEPT < 70
