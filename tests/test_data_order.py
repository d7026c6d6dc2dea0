"""The data order is a pure function of (seed, step): world-size independent, resumable."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.config.schema import DataConfig
from orchestrator.data.datasets import load_dataset
from orchestrator.data.order import DataOrder, step_seed
from trainers.boosting import worker_rows


@pytest.mark.parametrize("world", [1, 2, 3, 4, 16])
def test_shards_cover_the_global_batch_whatever_the_world_size(world):
    order = DataOrder(seed=7, num_rows=1000, global_batch=64)
    for step in (0, 1, 15, 16, 40):
        shards = [order.shard(step, r, world) for r in range(world)]
        merged = np.sort(np.concatenate(shards))
        assert np.array_equal(merged, np.sort(order.global_batch_rows(step)))
        assert sum(len(s) for s in shards) == 64


def test_the_order_depends_on_seed_and_step_only():
    a, b = DataOrder(3, 500, 32), DataOrder(3, 500, 32)
    b.global_batch_rows(40)  # a different history of calls changes nothing
    for step in (0, 5, 15, 16, 31):
        assert np.array_equal(a.global_batch_rows(step), b.global_batch_rows(step))
    assert not np.array_equal(DataOrder(4, 500, 32).global_batch_rows(0), a.global_batch_rows(0))


def test_an_epoch_sees_every_row_once():
    order = DataOrder(0, 640, 64)
    rows = np.concatenate([order.global_batch_rows(s) for s in range(order.steps_per_epoch)])
    assert sorted(rows.tolist()) == list(range(640))
    assert not np.array_equal(order.global_batch_rows(0), order.global_batch_rows(10))


def test_step_seeds_differ_by_step_and_rank():
    seeds = {step_seed(0, s, r) for s in range(50) for r in range(4)}
    assert len(seeds) == 200


def test_bundled_digits_split_is_seeded():
    cfg = DataConfig(name="digits")
    a, b, c = load_dataset(cfg, 0), load_dataset(cfg, 0), load_dataset(cfg, 1)
    assert a.num_classes == 10 and a.num_features == 64
    assert len(a.y_train) + len(a.y_test) == 1797
    assert np.array_equal(a.y_test, b.y_test) and not np.array_equal(a.y_test, c.y_test)


def test_synthetic_data_has_the_asked_shape_and_is_learnable():
    ds = load_dataset(DataConfig(name="synthetic", rows=2000, features=8, classes=3), seed=5)
    assert ds.x_train.shape[1] == 8 and ds.num_classes == 3
    assert len(ds.y_train) + len(ds.y_test) == 2000
    # Nearest class mean beats chance by far: there is signal to learn.
    means = np.stack([ds.x_train[ds.y_train == k].mean(0) for k in range(3)])
    pred = np.argmin(((ds.x_test[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    assert (pred == ds.y_test).mean() > 0.6


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_boosting_shards_cover_every_row_once_whatever_the_world_size(world):
    """A resized boosting job re-shards the same rows over the workers it has now."""
    shards = [worker_rows(1001, rank, world) for rank in range(world)]
    assert np.array_equal(np.sort(np.concatenate(shards)), np.arange(1001))
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1


def test_a_parquet_label_says_its_task_only_when_it_is_unambiguous(tmp_path):
    """Integer (or string) labels are classes; float labels may be either, so they must say:
    a float target with 10,000 distinct values is not a 10,000-class problem."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import pytest

    from orchestrator.data.datasets import data_facts, load_dataset
    from orchestrator.errors import ConfigError

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3))
    pq.write_table(pa.table({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2],
                             "kind": rng.integers(0, 4, 200), "price": x.sum(1) * 100.0}),
                   tmp_path / "t.parquet")
    path = str(tmp_path / "t.parquet")
    facts = data_facts(DataConfig(name="parquet", path=path, label="kind"))
    assert (facts.features, facts.outputs, facts.task) == (4, 4, "classification")
    with pytest.raises(ConfigError, match="data.task: the label column 'price' holds double"):
        data_facts(DataConfig(name="parquet", path=path, label="price"))
    regression = DataConfig(name="parquet", path=path, label="price", task="regression")
    assert data_facts(regression).outputs == 1
    data = load_dataset(regression, seed=0)
    assert data.task == "regression" and data.num_classes == 0 and data.y_train.dtype == np.float32
    pq.write_table(pa.table({"a": x[:, 0], "kind": np.array(["x", "y"] * 100)}),
                   tmp_path / "text.parquet")
    with pytest.raises(ConfigError, match=r"data.task=regression: the label column 'kind' holds "
                       r"string, not numbers"):
        data_facts(DataConfig(name="parquet", path=str(tmp_path / "text.parquet"), label="kind",
                              task="regression"))
    # A held-out file with a class the training data lacks: said by the driver (in memory,
    # the workers found it out, each failing in turn).
    pq.write_table(pa.table({"a": x[:20, 0], "kind": np.arange(20) % 6}), tmp_path / "held.parquet")
    with pytest.raises(ConfigError, match=r"data.eval_path=.*held.parquet': label values that "
                       r"data.path does not have \(4, 5\)"):
        data_facts(DataConfig(name="parquet", path=path, label="kind", columns=["a"],
                              eval_path=str(tmp_path / "held.parquet")))
    # One class is no classification (XGBoost said "trainer.params: ... num_class" of it).
    pq.write_table(pa.table({"a": x[:, 0], "kind": np.ones(200, dtype=np.int64)}),
                   tmp_path / "one.parquet")
    with pytest.raises(ConfigError, match=r"data.label='kind': the label column of data.path=.* "
                       r"holds one value \(1\): a classifier needs two classes or more"):
        data_facts(DataConfig(name="parquet", path=str(tmp_path / "one.parquet"), label="kind"))
    assert np.allclose(np.sort(np.concatenate([data.y_train, data.y_test])),
                       np.sort(x.sum(1) * 100.0), atol=1e-3)  # the values, not class ids


def test_the_bundled_digits_are_scikit_learns():
    from sklearn.datasets import load_digits

    from orchestrator.data.datasets import digits

    x, y = digits()
    expected = load_digits()
    assert np.array_equal(x, expected.data) and np.array_equal(y, expected.target)
    assert x.shape == (1797, 64) and set(y.tolist()) == set(range(10))


class _Augmenting:
    """A user's dataset whose items draw random numbers (augmentation) from torch, random and
    numpy."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        import random

        import torch

        return torch.tensor([float(index), torch.rand(()).item(), random.random(),
                             float(np.random.rand())])


def test_a_users_augmentation_draws_the_same_after_a_resume_at_any_world_size_and_loader():
    """Issue 26, 11: the random numbers a user's dataset draws for an item at a step (from
    torch, random and numpy) are the same in an uninterrupted run, in a resumed one, at another
    world size and with or without DataLoader worker processes (each item's fetch is seeded
    from (seed, step, item); unseeded, a worker process's draws depend on which process fetched
    the batch and how many it fetched before, which a resume changes). The loop's own random
    state is left as it was."""
    import torch
    from torch.utils.data import default_collate

    from orchestrator.worker_api import Batches
    from trainers.pytorch.data import EVERY_RANK, StepPlan, step_batches

    def feed(world: int, workers: int, start: int) -> dict[tuple[int, int], list[float]]:
        """(step, item) -> the draws, over every rank."""
        drawn = {}
        for rank in range(world):
            plan = StepPlan(Batches(DataOrder(7, 64, 8), rank, world), world, micro_batch_size=2)
            batches = step_batches(_Augmenting(), plan, start, 12, default_collate, workers,
                                   torch.device("cpu"), lambda s: step_seed(7, s, EVERY_RANK))
            for step in range(start, 12):
                for _ in plan.micro_batches(step):
                    torch.manual_seed(step)  # the loop's own seeding, before its fetches
                    batch = next(batches)
                    loops = torch.rand((), generator=torch.Generator().manual_seed(step))
                    assert torch.rand(()) == loops  # the fetch left the loop's state alone
                    for row in batch.tolist():
                        drawn[(step, int(row[0]))] = row[1:]
        return drawn

    whole = feed(2, 2, 0)
    resumed = {k: v for k, v in whole.items() if k[0] >= 5}
    assert feed(2, 2, 5) == resumed
    assert feed(1, 0, 5) == resumed
    assert feed(2, 0, 0) == whole
    assert len({v[0] for v in whole.values()}) == len(whole)  # every item draws its own numbers


@pytest.mark.parametrize("batch, world, micro", [(64, 3, 2), (12, 5, 2), (10, 4, 4), (8, 2, None)])
def test_micro_batches_have_two_rows_or_more_and_the_same_count_on_every_rank(batch, world, micro):
    """BatchNorm refuses one row in training: a rank's smaller share (64 rows on 3 workers: 22,
    21, 21) is cut into parts of 2 or more and padded up to the count every rank runs."""
    from orchestrator.worker_api import Batches
    from trainers.pytorch.data import StepPlan

    counts = set()
    for rank in range(world):
        plan = StepPlan(Batches(DataOrder(0, 100, batch), rank, world), world, micro)
        parts = plan.micro_batches(3)
        counts.add(len(parts))
        trained = [p for p in parts if p.weight]
        assert all(len(p.rows) >= 2 for p in parts), [len(p.rows) for p in parts]
        assert np.array_equal(np.concatenate([p.rows for p in trained]), plan.batches.rows(3))
    assert len(counts) == 1


class _WhereItsTempFilesGo:
    """Items that say which process fetched them and where its temporary files go."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        import os
        import tempfile

        import torch

        return torch.zeros(4), tempfile.gettempdir(), os.getpid()


LOADER_THEN_WAIT = """
import json, time
from torch.utils.data import DataLoader
from tests.test_data_order import _WhereItsTempFilesGo
from trainers.pytorch.data import temporary_files_of_its_own
it = iter(DataLoader(_WhereItsTempFilesGo(), batch_size=2, num_workers=2,
                     worker_init_fn=temporary_files_of_its_own))
_, folders, pids = next(it)
_, more, more_pids = next(it)
print(json.dumps([sorted(set(folders + more)), sorted(set(pids.tolist() + more_pids.tolist()))]),
      flush=True)
time.sleep(600)
"""


def test_a_loader_processs_temporary_files_are_private_and_go_with_it_killed_or_not(
        monkeypatch):
    """Issue 60, 1: each DataLoader process keeps its temporary files (multiprocessing's
    pymp-* folder with the socket it passes tensors through) in a private folder of its own,
    which it removes as it ends; killed with its rank, it leaves that folder, not a pymp-*
    folder in the shared temporary folder, and the folder goes once the process is gone (the
    next loader process or command on the node removes it)."""
    import json
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    from torch.utils.data import DataLoader

    from orchestrator.private_dir import (
        BASE_VARIABLE,
        PROCESS_DIRS,
        alive,
        problem,
        remove_dead_dirs,
    )
    from trainers.pytorch.data import LOADER_DIR, temporary_files_of_its_own

    base = Path(tempfile.mkdtemp(prefix="o-", dir="/tmp"))  # short: its sockets fit below
    monkeypatch.setenv(BASE_VARIABLE, str(base / "private"))
    processes = base / "private" / PROCESS_DIRS

    def check(folders: list[str], pids: list[int]) -> None:
        assert len(pids) == 2 and len(folders) == 2  # one folder each, named by its process
        for folder in map(Path, folders):
            assert folder.parent == processes and not problem(os.lstat(folder))
            assert folder.name.startswith(f"{LOADER_DIR}-")
            assert int(folder.name.split("-")[1]) in pids
            assert list(folder.glob("pymp-*/listener-*"))  # its socket is there, not in /tmp

    try:
        it = iter(DataLoader(_WhereItsTempFilesGo(), batch_size=2, num_workers=2,
                             worker_init_fn=temporary_files_of_its_own))
        seen = [next(it) for _ in range(4)]
        check(sorted({folder for _, folders, _ in seen for folder in folders}),
              sorted({pid for _, _, pids in seen for pid in pids.tolist()}))
        del it  # its processes end and take their folders with them
        assert not list(processes.iterdir())

        killed = subprocess.Popen([sys.executable, "-c", LOADER_THEN_WAIT], text=True,
                                  stdout=subprocess.PIPE, start_new_session=True,
                                  cwd=Path(__file__).parent.parent)
        try:
            folders, pids = json.loads(killed.stdout.readline())
            check(folders, pids)
        finally:
            os.killpg(killed.pid, signal.SIGKILL)  # the rank and its loader processes
            killed.wait()
        assert sorted(map(str, processes.iterdir())) == sorted(folders)  # left by the kill
        deadline = time.monotonic() + 60  # until init has reaped the orphaned loaders
        while any(map(alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        remove_dead_dirs()
        assert not list(processes.iterdir())
    finally:
        shutil.rmtree(base, ignore_errors=True)
