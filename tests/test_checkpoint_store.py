"""Checkpoint commit, discovery, corruption and retention on a local directory; the
multi-writer protocol (every rank's part, manifest last); the checkpoint policy."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from orchestrator.checkpoint.committer import Committer
from orchestrator.checkpoint.names import unsafe_reason
from orchestrator.checkpoint.policy import CheckpointPolicy
from orchestrator.checkpoint.retry import Backoff
from orchestrator.checkpoint.store import (
    MANIFEST,
    PARTS,
    CheckpointStore,
    CorruptCheckpoint,
    IncompleteCheckpoint,
    local_files,
    open_source,
    part_name,
    step_dir,
)
from orchestrator.config.schema import Config, StorageConfig
from orchestrator.driver.run_plan import make_plan
from orchestrator.errors import ConfigError
from orchestrator.storage.location import StorageSpec
from orchestrator.worker_api import matching
from tests.helpers import (
    assert_planted_one_refused,
    bad_names,
    load_newest_intact,
    plant_manifest,
    rank_folder,
    stored_path,
)


@pytest.fixture
def store(tmp_path):
    return CheckpointStore(StorageSpec(str(tmp_path / "run")))


def test_a_checkpoint_is_committed_by_its_manifest(store, tmp_path):
    saved = store.save(10, {"model.pt": b"abc", "optimizer.pt": b"xyz"}, {"step": 10})
    assert saved.bytes == 6 and saved.ref.step == 10
    manifest = json.loads((tmp_path / "run" / step_dir(10) / MANIFEST).read_text())
    assert manifest["files"]["model.pt"]["bytes"] == 3
    ref, files, meta = load_newest_intact(store, tmp_path)
    assert ref.step == 10 and files == {"model.pt": b"abc", "optimizer.pt": b"xyz"}
    assert meta == {"step": 10}


def test_a_folder_without_manifest_is_never_the_latest(store, tmp_path):
    store.save(10, {"a": b"1"})
    partial = tmp_path / "run" / step_dir(20)
    partial.mkdir()
    (partial / "a").write_bytes(b"half")
    assert [r.step for r in store.committed()] == [10]
    assert store.latest().step == 10


def test_a_corrupt_checkpoint_falls_back_to_the_older_one(store, tmp_path):
    store.save(10, {"a": b"good"})
    store.save(20, {"a": b"newer"})
    Path(stored_path(tmp_path / "run" / step_dir(20), "a")).write_bytes(b"rot!!")
    ref, files, _ = load_newest_intact(store, tmp_path)
    assert ref.step == 10 and files["a"] == b"good"


def test_committed_checkpoints_are_never_overwritten(store):
    store.save(10, {"a": b"first"})
    store.save(10, {"a": b"second"})
    assert store.load(store.latest())[0]["a"] == b"first"


def test_prune_keeps_the_newest_and_the_protected(store):
    for step in (10, 20, 30, 40):
        store.save(step, {"a": str(step).encode()})
    removed = store.prune(keep=2, protect={10})
    assert removed == [20]
    assert [r.step for r in store.committed()] == [10, 30, 40]
    assert store.prune(keep=0) == []


def test_retention_goes_by_commit_order_so_a_run_that_resumed_older_keeps_its_work(tmp_path):
    """Steps 800/900/1000 exist; a new attempt resumed from 800 (the newer ones unreadable).
    Sorted by step, its fresh step-850 checkpoint was the oldest and deleted on commit."""
    before = CheckpointStore(StorageSpec(str(tmp_path / "run")))
    for step in (800, 900, 1000):
        before.save(step, {"a": str(step).encode()})
    after = CheckpointStore(StorageSpec(str(tmp_path / "run")))  # the new attempt's store
    after.save(850, {"a": b"850"})
    assert after.prune(keep=3, protect={800}) == []  # 800 is protected: nothing else is older
    after.save(950, {"a": b"950"})
    assert after.prune(keep=3, protect={800}) == [900]
    after.save(1050, {"a": b"1050"})
    assert after.prune(keep=3, protect={800}) == [1000]
    assert [r.step for r in after.committed()] == [800, 850, 950, 1050]
    # A later attempt that started over at step 0 keeps its step 50 over all of those, too.
    again = CheckpointStore(StorageSpec(str(tmp_path / "run")))
    again.save(50, {"a": b"50"})
    assert again.prune(keep=2) == [800, 850, 950]
    assert [r.step for r in again.committed()] == [50, 1050]


def test_manifests_without_a_readable_sequence_come_first(store, tmp_path):
    store.save(10, {"a": b"1"})
    store.save(20, {"a": b"2"})
    store.save(30, {"a": b"3"})
    legacy = tmp_path / "run" / step_dir(30) / MANIFEST
    legacy.write_text(json.dumps({k: v for k, v in json.loads(legacy.read_text()).items()
                                  if k != "sequence"}))  # as written before manifests had one
    (tmp_path / "run" / step_dir(10) / MANIFEST).write_text("{not json")
    assert [store.commit_order(r)[0] for r in store.committed()] == [-1, 2, 0]
    assert store.prune(keep=1) == [10, 30]


def test_resume_source_is_a_checkpoint_or_a_run_folder(store, tmp_path):
    store.save(10, {"a": b"1"})
    store.save(20, {"a": b"2"})
    run = StorageSpec(str(tmp_path / "run"))
    assert open_source(run)[1].step == 20
    assert open_source(run.child(step_dir(10)))[1].step == 10
    assert open_source(StorageSpec(str(tmp_path / "elsewhere"))) is None


@pytest.mark.parametrize("removed", ["pruned", "deleted"])
def test_a_resume_source_that_is_gone_is_an_input_error(store, tmp_path, removed):
    """resume=<uri> whose checkpoint retention pruned, or someone deleted: the driver stops
    with one line naming it (exit 2), never a silent fresh start."""
    store.save(10, {"a": b"1"})
    store.save(20, {"a": b"2"})
    if removed == "pruned":
        assert store.prune(keep=1) == [10]
        gone = str(tmp_path / "run" / step_dir(10))
    else:
        shutil.rmtree(tmp_path / "run")
        gone = str(tmp_path / "run")
    cfg = Config(storage=StorageConfig(uri=str(tmp_path / "ckpt")), resume=gone)
    with pytest.raises(ConfigError) as refused:
        make_plan(cfg, {"name": "t"}, {"name": "d"})
    assert refused.value.exit_code == 2 and "\n" not in str(refused.value)
    assert str(refused.value).startswith(f"resume={gone!r}: no committed checkpoint there")
    assert not (tmp_path / "ckpt").exists()


def test_every_ranks_part_is_committed_together_manifest_last(store, tmp_path):
    """Three ranks each write a file (rank 2 a nested one, rank 1 none): the checkpoint is
    committed once, by rank 0, listing every rank's files; the snapshots are taken over."""
    files = {0: {"model.pt": b"weights"}, 1: {}, 2: {"shards/2.bin": b"x" * 5000}}
    committed = []
    committers = [Committer(store, rank, 3, "att1", asynchronous=True,
                            on_commit=committed.append) for rank in range(3)]
    folders = {rank: rank_folder(tmp_path, rank, files[rank]) for rank in range(3)}
    committers[0].snapshot(10, folders[0], {"step": 10}, save_s=0.5)
    committers[2].snapshot(10, folders[2], {"step": 10})
    assert not store.is_committed(10)  # rank 1's part (empty) is not there yet
    committers[1].snapshot(10, folders[1], {"step": 10})
    for c in committers:
        c.close()
    assert [c.saved.ref.step for c in committed] == [10] and committed[0].save_s == 0.5
    manifest = store.read_manifest(store.latest())
    assert manifest["world_size"] == 3
    assert {n: e["rank"] for n, e in manifest["files"].items()} == {"model.pt": 0, "shards/2.bin": 2}
    assert not any(f.exists() for f in folders.values())
    ref, got, _ = load_newest_intact(store, tmp_path)
    assert got == {"model.pt": b"weights", "shards/2.bin": b"x" * 5000}


def test_files_a_future_finishes_are_uploaded_after_it_and_a_failed_one_commits_nothing(
        store, tmp_path):
    """write(dir) may return a future (DCP's async_save): the committer uploads the folder
    only once it resolves, and a future that raises leaves the checkpoint uncommitted."""
    release, failures = threading.Event(), []
    committer = Committer(store, 0, 1, "att", asynchronous=True,
                          on_failure=lambda step, exc: failures.append((step, str(exc))))
    folder = rank_folder(tmp_path, 0, {})
    pending = Future()

    def finish() -> None:  # the background write, done after the step went on
        release.wait(10)
        (folder / "shard.bin").write_bytes(b"s" * 300)
        pending.set_result(None)

    threading.Thread(target=finish).start()
    committer.snapshot(5, folder, {"step": 5}, pending=pending)
    assert not store.is_committed(5)  # still being written: nothing uploaded
    release.set()
    committer.flush()
    assert store.read_manifest(store.latest())["files"]["shard.bin"]["bytes"] == 300

    failed = Future()
    failed.set_exception(OSError("disk full"))
    later = rank_folder(tmp_path / "later", 0, {"shard.bin": b"partial"})
    committer.snapshot(6, later, {"step": 6}, pending=failed)
    committer.close()
    assert failures == [(6, "disk full")] and store.latest().step == 5 and not later.exists()


def test_a_missing_part_is_never_committed_and_the_older_checkpoint_stays_latest(store, tmp_path):
    store.save(10, {"model.pt": b"old"})
    failures = []
    rank0 = Committer(store, 0, 2, "att2", asynchronous=False, on_failure=lambda s, e: failures.append(e),
                      backoff=Backoff(deadline_s=0.5))
    rank0.snapshot(20, rank_folder(tmp_path, 0, {"model.pt": b"new"}), {})  # rank 1 died
    assert isinstance(failures[0], IncompleteCheckpoint) and "rank(s) [1]" in str(failures[0])
    assert store.latest().step == 10
    # Parts of an earlier attempt at the same step do not count for a new one.
    Committer(store, 1, 2, "att2", asynchronous=False).snapshot(20, rank_folder(tmp_path, 1, {}), {})
    rank0 = Committer(store, 0, 2, "att3", asynchronous=False, backoff=Backoff(deadline_s=0.5))
    rank0.snapshot(20, rank_folder(tmp_path / "again", 0, {"model.pt": b"new"}), {})
    assert store.latest().step == 10


def test_rank_0_learns_at_once_that_a_rank_gave_its_part_up(tmp_path):
    """Issue 26, 4: rank 1's upload failed for good (its budget spent); rank 0, with minutes
    left to wait, stops waiting as soon as rank 1 says so, naming it and why."""
    import time

    spec = StorageSpec(str(tmp_path / "run"))
    broken = CheckpointStore(spec)

    def refuse(local, remote, linked=False):
        raise OSError("No space left on device")

    broken._store_file = refuse
    failures = []
    Committer(broken, 1, 2, "att", asynchronous=False, backoff=Backoff(0.01, 0.02, 0.1),
              on_failure=lambda s, e: failures.append(e)).snapshot(
        10, rank_folder(tmp_path / "r1", 1, {"rank_1.pt": b"1"}), {})
    started = time.monotonic()
    Committer(CheckpointStore(spec), 0, 2, "att", asynchronous=False, backoff=Backoff(deadline_s=300),
              on_failure=lambda s, e: failures.append(e)).snapshot(
        10, rank_folder(tmp_path / "r0", 0, {"rank_0.pt": b"0"}), {})
    assert time.monotonic() - started < 10
    assert isinstance(failures[1], IncompleteCheckpoint), failures
    assert "rank(s) [1] gave their part up: No space left on device" in str(failures[1])
    assert CheckpointStore(spec).latest() is None


def test_a_checkpoints_retries_share_one_budget(store, tmp_path):
    """Issue 26, 4: every operation retried within its own deadline made a checkpoint's worst
    case the sum of them (uploads, size checks, part record, wait, commit: 5 x 600 s). Here
    the part record and the manifest each need 0.2 s of retries, 0.4 s together: each fits a
    0.3 s deadline alone, not a checkpoint's budget of 0.3 s."""
    import time

    real, calls = store._write_atomically, {"n": 0}

    def flaky(path, data):  # every write fails twice, then goes through
        calls["n"] += 1
        if calls["n"] % 3:
            raise OSError("HTTP 503 Slow Down")
        return real(path, data)

    store._write_atomically = flaky
    failures = []
    started = time.monotonic()
    Committer(store, 0, 1, "att", asynchronous=False, backoff=Backoff(0.1, 0.1, 0.3),
              on_failure=lambda s, e: failures.append(e)).snapshot(
        10, rank_folder(tmp_path, 0, {"m.pt": b"w"}), {})
    assert "503" in str(failures[0]) and store.latest() is None
    assert time.monotonic() - started < 0.35
    assert calls["n"] < 6  # the commit never got its third try (it would have gone through)


class FlakyListings:
    """The store's filesystem, whose next ``failures`` listings of a .parts folder fail (an
    S3 503, a dropped connection); everything else goes through to the real one."""

    def __init__(self, fs, failures: int):
        self.fs, self.failures = fs, failures

    def get_file_info(self, what):
        if isinstance(what, pafs.FileSelector) and what.base_dir.endswith(PARTS) and self.failures:
            self.failures -= 1
            raise OSError("listing failed: HTTP 503 Slow Down")
        return self.fs.get_file_info(what)

    def __getattr__(self, name):
        return getattr(self.fs, name)


def test_a_listing_error_while_waiting_for_parts_is_retried(store, tmp_path):
    """The wait for every rank's part gave the checkpoint up at the first listing error,
    though its parts were all there; it now retries like every other operation."""
    store.fs, failures = FlakyListings(store.fs, failures=2), []
    fast = Backoff(first_s=0.01, max_s=0.02, deadline_s=5)
    Committer(store, 0, 1, "att", asynchronous=False, backoff=fast,
              on_failure=lambda s, e: failures.append(e)).snapshot(
        10, rank_folder(tmp_path / "10", 0, {"m.pt": b"w"}), {})
    assert failures == [] and store.fs.failures == 0 and store.latest().step == 10
    # One that outlasts the wait gives the checkpoint up, with the listing's error.
    store.fs.failures = 10**6
    Committer(store, 0, 1, "att", asynchronous=False, backoff=Backoff(0.01, 0.02, 0.2),
              on_failure=lambda s, e: failures.append(e)).snapshot(
        20, rank_folder(tmp_path / "20", 0, {"m.pt": b"w"}), {})
    assert "503 Slow Down" in str(failures[0]) and store.latest().step == 10


class CountedListings:
    """The store's filesystem, counting the listings of a .parts folder; each listing is an
    event a test can wait for."""

    def __init__(self, fs):
        self.fs, self.listings, self.listed = fs, 0, threading.Condition()

    def get_file_info(self, what):
        found = self.fs.get_file_info(what)
        if isinstance(what, pafs.FileSelector) and what.base_dir.endswith(PARTS):
            with self.listed:
                self.listings += 1
                self.listed.notify_all()
        return found

    def after(self, count: int) -> int:
        with self.listed:
            assert self.listed.wait_for(lambda: self.listings > count, timeout=60)
            return self.listings

    def __getattr__(self, name):
        return getattr(self.fs, name)


def test_rank_0_reads_each_ranks_part_record_once_however_often_it_lists(store, tmp_path):
    """Rank 0 read every part record at every poll while it waited: N ranks arriving one by
    one cost it ~N^2/2 reads (at 1,024 ranks, half a million requests to an object store for
    one checkpoint). Each record is written once: it is read once."""
    world = 8
    store.fs, reads = CountedListings(store.fs), []
    real_read = store._read_record
    store._read_record = lambda step, name, where: (reads.append(name), real_read(step, name, where))[1]
    fast = Backoff(first_s=0.01, max_s=0.02, deadline_s=60)
    rank0 = threading.Thread(target=Committer(store, 0, world, "att", asynchronous=False,
                                              backoff=fast).snapshot,
                             args=(10, rank_folder(tmp_path / "r0", 0, {"rank_0.pt": b"0"}), {}))
    rank0.start()
    seen = store.fs.after(0)
    for rank in range(1, world):  # each part arrives after rank 0 listed the ones before
        Committer(store, rank, world, "att", asynchronous=False).snapshot(
            10, rank_folder(tmp_path / f"r{rank}", rank, {f"rank_{rank}.pt": b"%d" % rank}), {})
        seen = store.fs.after(seen)
    rank0.join(timeout=60)
    assert store.latest().step == 10 and store.fs.listings >= world
    assert sorted(r for r in reads if r.startswith(PARTS)) == sorted(
        f"{PARTS}/{part_name('att', rank)}" for rank in range(world))


def test_a_local_checkpoint_is_fetched_as_its_manifests_files_only(store, tmp_path):
    """A world-size-4 attempt that never committed left its rank_3.json in the step's folder,
    and every attempt its part record in .parts/: a local store's fetch (what restore()
    returns) handed over that live folder, where an object store gives the manifest's files."""
    Committer(store, 3, 4, "a4", asynchronous=False).snapshot(
        10, rank_folder(tmp_path / "a4", 3, {"rank_3.json": b"3"}), {})
    for rank in (1, 0):
        Committer(store, rank, 2, "a2", asynchronous=False).snapshot(
            10, rank_folder(tmp_path / "a2", rank, {f"rank_{rank}.json": b"%d" % rank}), {})
    live = tmp_path / "run" / step_dir(10)
    assert (live / "a4" / "rank_3.json").is_file() and (live / PARTS).is_dir()
    view = store.fetch(store.latest(), tmp_path / "cache")
    assert view != live and sorted(p.name for p in view.iterdir()) == [
        MANIFEST, "rank_0.json", "rank_1.json"]
    assert (view / "rank_1.json").read_bytes() == b"1"
    # A file found corrupt there fails the fetch, and leaves no half-made view behind.
    Path(stored_path(live, "rank_1.json")).write_bytes(b"x")
    with pytest.raises(CorruptCheckpoint, match="rank_1.json does not match"):
        store.fetch(store.latest(), tmp_path / "cache")
    assert not (tmp_path / "cache" / step_dir(10)).exists()


def test_a_rank_fetches_only_the_files_it_loads_and_more_on_asking(store, tmp_path):
    """restore(files=...): a rank of a sharded job fetches its own shard and the metadata, not
    every rank's; asked again, the same folder gets more; a file that fails its check leaves
    the files fetched before as they were."""
    for rank in (1, 0):
        files = {f"dcp/__{rank}_0.distcp": b"shard%d" % rank}
        if rank == 0:
            files["dcp/.metadata"] = b"meta"
        Committer(store, rank, 2, "a2", asynchronous=False).snapshot(
            10, rank_folder(tmp_path / "a2", rank, files), {})
    ref, cache = store.latest(), tmp_path / "cache"
    folder, nbytes = store.fetch_some(ref, cache, matching(["dcp/*.metadata", "dcp/__1_*"]))
    assert sorted(local_files(folder)) == sorted([MANIFEST, "dcp/.metadata", "dcp/__1_0.distcp"])
    assert nbytes == len(b"meta") + len(b"shard1")
    again, more = store.fetch_some(ref, cache, matching("dcp/__0_0.distcp"))
    assert again == folder and more == len(b"shard0")
    assert (folder / "dcp" / "__0_0.distcp").read_bytes() == b"shard0"
    assert store.fetch_some(ref, cache, matching("dcp/*"))[1] == 0  # nothing left to fetch
    # A file found corrupt on a later ask: that file is not left, the others stay.
    (folder / "dcp" / "__0_0.distcp").unlink()
    Path(stored_path(Path(ref.path), "dcp/__0_0.distcp")).write_bytes(b"x")
    with pytest.raises(CorruptCheckpoint):
        store.fetch_some(ref, cache, matching("dcp/__0_0.distcp"))
    assert sorted(local_files(folder)) == sorted([MANIFEST, "dcp/.metadata", "dcp/__1_0.distcp"])


def test_a_cache_on_another_disk_links_the_files_symbolically(store, tmp_path, monkeypatch):
    def cross_device(src, dst, **options):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    store.save(10, {"model.pt": b"weights"})
    monkeypatch.setattr(os, "link", cross_device)
    view = store.fetch(store.latest(), tmp_path / "cache")
    assert (view / "model.pt").is_symlink() and (view / "model.pt").read_bytes() == b"weights"
    assert sorted(p.name for p in view.iterdir()) == [MANIFEST, "model.pt"]


def test_two_ranks_writing_the_same_file_is_refused(store, tmp_path):
    failures = []
    threads = [threading.Thread(target=Committer(
        store, rank, 2, "att", asynchronous=False, on_failure=lambda s, e: failures.append(e),
        backoff=Backoff(deadline_s=5)).snapshot,
        args=(10, rank_folder(tmp_path, rank, {"model.pt": b"%d" % rank}), {})) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "both wrote 'model.pt'" in str(failures[0])
    assert store.latest() is None


def test_a_corrupt_rank_file_makes_the_loader_fall_back(store, tmp_path):
    for step in (10, 20):
        parts = [Committer(store, r, 2, f"a{step}", asynchronous=False) for r in (1, 0)]
        for c in parts:  # rank 1 first: rank 0 finds its part and commits
            c.snapshot(step, rank_folder(tmp_path / str(step), c.rank, {f"rank{c.rank}.bin": b"%d" % step}), {})
    Path(stored_path(tmp_path / "run" / step_dir(20), "rank1.bin")).write_bytes(b"xx")  # same size
    skipped: list[str] = []
    ref, files, _ = load_newest_intact(store, tmp_path, skipped)
    assert ref.step == 10 and files == {"rank0.bin": b"10", "rank1.bin": b"10"}
    assert "step_000000020/rank1.bin does not match its manifest" in skipped[0]


# -- a checkpoint planted by someone who can write the storage ------------------------------


@pytest.mark.parametrize("kind", ["absolute", "dotdot"])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused(store, tmp_path, kind):
    name = bad_names(tmp_path)[kind]
    store.save(10, {"a": b"good"})
    plant_manifest(store, 20, name)
    assert_planted_one_refused(store, tmp_path, name)


@pytest.mark.parametrize("name", ["a", "shards/rank_1.bin", ".metadata", "dcp/__0_0.distcp"])
def test_plain_relative_names_are_checkpoint_files(name):
    assert unsafe_reason(name) is None


@pytest.mark.parametrize(
    "name, why",
    [("/etc/passwd", "absolute"), ("../x", "'..'"), ("a/../../b", "'..'"), ("a//b", "empty"),
     ("a/", "empty"), ("a\\..\\b", "backslash"), ("", "non-empty"), ("./a", "'.'"),
     ("a\x00b", "control"), (7, "string")],
)
def test_names_that_could_leave_the_folder_are_refused(name, why):
    assert why in unsafe_reason(name)


def test_such_names_are_never_written(store, tmp_path):
    with pytest.raises(CorruptCheckpoint, match="'../escape'"):
        store.save(10, {"../escape": b"x"})
    assert not (tmp_path / "escape").exists() and store.latest() is None
    part = {"files": {"/tmp/x": {"bytes": 1, "sha256": "0" * 64}}}  # a forged part record
    with pytest.raises(CorruptCheckpoint, match="rank 1's part record"):
        store.commit(10, {0: {"files": {}}, 1: part}, {})
    assert store.latest() is None


@pytest.mark.parametrize(
    "every_steps, every_seconds, events, expected",
    [
        (5, None, [(1, 0.0), (5, 0.1), (6, 0.2), (10, 0.3)], [False, True, False, True]),
        (None, 10.0, [(1, 0.0), (2, 5.0), (3, 10.5), (4, 11.0)], [False, False, True, False]),
        (None, None, [(1, 0.0), (100, 999.0)], [False, False]),
    ],
)
def test_checkpoint_policy(every_steps, every_seconds, events, expected):
    policy = CheckpointPolicy(every_steps, every_seconds)
    policy.start(0.0)
    decisions = []
    for step, now in events:
        decision = policy.due_by_step(step) or policy.due_by_time(now)
        if decision:
            policy.saved(now)
        decisions.append(decision)
    assert decisions == expected


def test_the_checkpoint_clock_starts_after_the_first_step_not_at_start_up():
    """every_seconds=2 saved at step 1 when a 30 s start-up counted as training time."""
    policy = CheckpointPolicy(50, 2.0)
    assert not policy.due_by_time(30.0)  # Ray, the restore, the first step: not counted
    policy.start(30.0)  # the first step ended
    policy.start(31.0)  # later steps do not move it
    assert not policy.due_by_time(31.9) and policy.due_by_time(32.0)


def test_an_error_after_a_commit_does_not_end_the_upload_thread(store, tmp_path):
    """Retention or the record failing after a commit (an S3 error while listing, ENOTEMPTY on
    NFS) used to kill the upload thread: later saves then blocked on a queue nobody read."""
    seen = []

    def on_commit(done):
        seen.append(done.saved.ref.step)
        raise OSError("listing failed")

    committer = Committer(store, 0, 1, "att", asynchronous=True, on_commit=on_commit)
    for step in (10, 20, 30, 40):  # more than the queue holds: a dead thread would block here
        committer.snapshot(step, rank_folder(tmp_path / str(step), 0, {"m.pt": b"w"}), {})
    committer.close()
    assert seen == [10, 20, 30, 40] and [r.step for r in store.committed()] == [10, 20, 30, 40]


def test_a_save_never_waits_long_for_a_stalled_upload_the_oldest_waiting_one_is_dropped(
        store, tmp_path, monkeypatch):
    """Issue 26, 4: with the storage stalled, the 4th save blocked until an upload finished
    (a whole outage). It now waits at most Committer.MAX_WAIT_S; then the oldest waiting
    snapshot is dropped, the newest goes next, and rank 0 is told at once (a failed part)."""
    monkeypatch.setattr(Committer, "MAX_WAIT_S", 0.2)
    stalled, real = threading.Event(), store._store_file

    def upload(local, remote, linked=False):
        stalled.wait(30)  # the storage answers once the outage ends
        return real(local, remote, linked)

    store._store_file = upload
    failures = []
    rank1 = Committer(store, 1, 2, "att", asynchronous=True,
                      on_failure=lambda s, e: failures.append((s, str(e))))
    blocked = [rank1.snapshot(step, rank_folder(tmp_path / str(step), 1, {"r1.pt": b"%d" % step}), {})
               for step in (10, 20, 30, 40, 50)]
    assert max(blocked) < 2, blocked
    assert [s for s, _ in failures] == [20, 30] and "uploads fell behind" in failures[0][1]
    stalled.set()
    rank1.close()
    assert rank1.committed_steps == [10, 40, 50]  # a part stored for each of these
    assert "uploads fell behind" in store.parts(20, "att")[1]["failed"]  # rank 0 stops waiting
    assert not any((tmp_path / str(s) / "snapshot-rank1").exists() for s in (20, 30))  # deleted


def test_leftovers_of_failed_writes_are_removed_when_a_worker_group_starts(tmp_path):
    """A killed rank's staging folder and a step never committed, older than the newest
    commit, go; a newer uncommitted step (written again anyway), a corrupt checkpoint's
    set-aside manifest and every committed checkpoint stay."""
    from orchestrator.checkpoint.cleanup import STAGING, remove_stale

    store = CheckpointStore(StorageSpec(str(tmp_path / "run")))
    store.save(10, {"a": b"10"})
    store.save(20, {"a": b"20"})
    root = tmp_path / "run"
    for leftover in (root / step_dir(15) / "a", root / step_dir(30) / "a",
                     root / step_dir(5) / "manifest.corrupt-1.json",
                     root / STAGING / "dead0attempt-rank_00001" / step_dir(20) / "shard"):
        leftover.parent.mkdir(parents=True, exist_ok=True)
        leftover.write_bytes(b"x" * 100)
    removed = remove_stale(store)
    assert sorted(p.rsplit("/", 1)[-1] for p in removed) == ["dead0attempt-rank_00001", step_dir(15)]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
        step_dir(5), step_dir(10), step_dir(20), step_dir(30)]
    assert [r.step for r in store.committed()] == [10, 20] and remove_stale(store) == []
    assert not (root / STAGING).exists()  # emptied, then removed itself


HOLD_A_WORKDIR = """
import sys, time
from orchestrator.worker.workdir import Workdir
w = Workdir(int(sys.argv[2]), sys.argv[1])
(w.path / "staging").mkdir()
(w.path / "staging" / "shard").write_bytes(b"x" * 1000)
print(w.path, flush=True)
time.sleep(600)
"""


def test_the_node_folders_of_killed_workers_go_with_the_next_worker_and_live_ones_stay(tmp_path):
    """A worker SIGKILLed (as a restart tears down its group) keeps its staged snapshot on the
    node's disk; the next worker to start or end there removes it, never a live worker's
    folder (another process's, or its own), nor a folder it cannot tell is a worker's, nor one
    another machine made (a shared TMPDIR, where that machine's lock may not show here)."""
    import signal
    import subprocess
    import sys

    from orchestrator.worker.workdir import Workdir

    def hold(rank):
        proc = subprocess.Popen([sys.executable, "-c", HOLD_A_WORKDIR, str(tmp_path), str(rank)],
                                stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
        return proc, Path(proc.stdout.readline().strip())

    (killed, dead), (alive, live) = hold(0), hold(1)
    other = tmp_path / "orchestrator-rank2-noowner"  # an older version's, or being made
    other.mkdir()
    elsewhere = tmp_path / "orchestrator-rank3-elsewhere"  # a shared TMPDIR: another machine's
    elsewhere.mkdir()
    (elsewhere / ".owner").write_text("another-host")  # unlocked here, maybe not there
    try:
        assert (dead / "staging" / "shard").exists() and (live / "staging" / "shard").exists()
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=60)
        assert (dead / "staging" / "shard").exists()  # a killed worker cleans nothing
        mine = Workdir(0, tmp_path)
        assert not dead.exists() and (live / "staging" / "shard").exists() and other.exists()
        assert (elsewhere / ".owner").exists()
        second = Workdir(1, tmp_path)  # this process's first folder is live too
        assert mine.path.exists() and second.path.exists()
        alive.send_signal(signal.SIGKILL)
        alive.wait(timeout=60)
        mine.remove()
        assert not mine.path.exists() and not live.exists() and second.path.exists()
        second.remove()
        second.remove()  # twice is harmless
        assert sorted(p.name for p in tmp_path.iterdir()) == [other.name, elsewhere.name]
    finally:
        for proc in (killed, alive):
            proc.kill()
            proc.wait(timeout=60)


def test_a_worker_folder_on_a_filesystem_without_locks_is_kept_out_of_the_sweeps(tmp_path,
                                                                               monkeypatch):
    """Where flock is not supported (some network filesystems), the worker still runs; its
    folder has no lock file, so no other worker ever takes it for abandoned."""
    import errno

    from orchestrator.worker import workdir

    def no_locks(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(workdir.fcntl, "flock", no_locks)
    mine = workdir.Workdir(0, tmp_path)
    assert mine.path.is_dir() and not (mine.path / workdir.OWNER).exists()
    monkeypatch.undo()
    assert workdir.remove_abandoned(tmp_path, workdir.PREFIX) == [] and mine.path.is_dir()
    mine.remove()
    assert not mine.path.exists()

def test_a_straggler_of_a_dead_attempt_cannot_touch_a_committed_checkpoint(store, tmp_path):
    """Issue 26, 7: a rank of an attempt that was given up (cut off by a partition) passed the
    committed check before the new attempt committed the same step, and uploads its part after
    it. Its files land under its own attempt's prefix: the committed checkpoint still reads
    whole, with the new attempt's bytes."""
    Committer(store, 0, 1, "newattempt", asynchronous=False).snapshot(
        10, rank_folder(tmp_path / "new", 0, {"model.pt": b"new weights"}), {})
    store.upload_part(10, 0, "oldattempt", rank_folder(tmp_path / "old", 0,
                                                         {"model.pt": b"old weightsXX"}))
    ref, files, _ = load_newest_intact(store, tmp_path)
    assert ref.step == 10 and files == {"model.pt": b"new weights"}
    live = tmp_path / "run" / step_dir(10)
    assert (live / "oldattempt" / "model.pt").read_bytes() == b"old weightsXX"
    assert stored_path(live, "model.pt") == str(live / "newattempt" / "model.pt")


def test_a_manifest_placing_a_file_outside_its_folder_is_refused(store, tmp_path):
    """Where a file lies (its key) is checked like its name: a planted key leaving the step
    folder makes the checkpoint corrupt; the older one is used."""
    store.save(10, {"a": b"good"})
    store.save(20, {"a": b"newer"})
    path = tmp_path / "run" / step_dir(20) / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["files"]["a"]["key"] = "../step_000000010/single/a"
    path.write_text(json.dumps(manifest))
    skipped: list[str] = []
    ref, files, _ = load_newest_intact(store, tmp_path, skipped)
    assert ref.step == 10 and files == {"a": b"good"}
    assert "'../step_000000010/single/a'" in skipped[0] and "'..' part" in skipped[0], skipped


def test_a_file_named_manifest_json_is_refused_and_a_linked_one_is_copied(store, tmp_path):
    """write() making manifest.json: the fetch wrote the orchestrator's manifest through the
    hard link into the committed file, and every restart lost the newest checkpoint. A file or
    folder linked into the snapshot (a tokenizer folder): the folder was left out, and a linked
    file was moved in as the link, so the checkpoint changed with the user's live file."""
    from orchestrator.checkpoint.store import ReservedFileName

    with pytest.raises(ReservedFileName, match="made 'manifest.json' in the checkpoint at step 10"):
        store.save(10, {"model.pt": b"w", "manifest.json": b"{}"})
    live = tmp_path / "live"
    (live / "tokenizer").mkdir(parents=True)
    (live / "tokenizer" / "vocab.txt").write_text("a b c")
    (live / "weights.bin").write_bytes(b"v1")
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    (snapshot / "weights.bin").symlink_to(live / "weights.bin")
    (snapshot / "tokenizer").symlink_to(live / "tokenizer")
    assert local_files(snapshot) == ["tokenizer/vocab.txt", "weights.bin"]
    part = store.upload_part(20, 0, "att", snapshot)
    store.commit(20, {0: {"files": part}}, {})
    (live / "weights.bin").write_bytes(b"v2, training went on")
    ref, files, _ = load_newest_intact(store, tmp_path)
    assert ref.step == 20 and files == {"weights.bin": b"v1", "tokenizer/vocab.txt": b"a b c"}
    assert (live / "weights.bin").exists()  # the user's file stays where it was


def test_cleaning_never_stops_a_run_and_the_driver_reads_past_a_corrupt_manifest(
        store, tmp_path, monkeypatch):
    from orchestrator.checkpoint.cleanup import remove_stale
    from orchestrator.driver.run_plan import newest_meta

    store.save(100, {"m": b"1"}, {"data": {"next_step": 100}})
    store.save(200, {"m": b"2"}, {"data": {"next_step": 200}})

    class Throttled:  # every listing answered 503 (an object store's SlowDown)
        def get_file_info(self, *args):
            raise OSError("AWS Error SLOW_DOWN (HTTP status 503)")

    real = store.fs
    monkeypatch.setattr(store, "fs", Throttled())
    assert remove_stale(store) == []  # a warning, not a raise (the run had succeeded)
    monkeypatch.setattr(store, "fs", real)
    (tmp_path / "run" / step_dir(200) / MANIFEST).write_text('{"files": {"../x": {}}}')
    assert newest_meta(store, store.committed())[1]["data"] == {"next_step": 100}


@pytest.mark.parametrize("endpoint", ["s3://127.0.0.1:8333", "HTTP://host:8333", "ftp://host"])
def test_an_endpoint_pyarrow_cannot_take_is_one_line(endpoint):
    with pytest.raises(ConfigError, match=r"^storage.endpoint=.* is not allowed: http://host:port"):
        StorageConfig(name="s3", uri="s3://bucket/p", endpoint=endpoint)
    for fine in ("https://s3.example.com", "http://127.0.0.1:8333", "minio.internal:9000"):
        StorageConfig(name="s3", uri="s3://bucket/p", endpoint=fine)  # no scheme: https


# -- a crafted or broken newest checkpoint, links in a store, durability -------------------


class KeysWithoutFolders:
    """A local filesystem that writes a key without its folder made first, as S3 does."""

    def __init__(self, fs):
        self.fs = fs

    def open_output_stream(self, path, *args, **options):
        self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        return self.fs.open_output_stream(path, *args, **options)

    def __getattr__(self, name):
        return getattr(self.fs, name)


def object_store(tmp_path: Path) -> CheckpointStore:
    """A store that reads and writes as an object store does (downloads checked as they
    stream, sizes as the store reports them, PUTs, no fsync), over a local folder: the object
    store's side of the code without a server."""
    fake = CheckpointStore(StorageSpec(str(tmp_path / "run")))
    fake.is_local, fake.fs = False, KeysWithoutFolders(fake.fs)
    return fake


@pytest.fixture(params=["local", "object"])
def any_store(request, tmp_path):
    if request.param == "object":
        return object_store(tmp_path)
    return CheckpointStore(StorageSpec(str(tmp_path / "run")))


def rewrite_manifest(store: CheckpointStore, step: int, change) -> None:
    """The committed manifest of ``step`` as ``change(manifest)`` leaves it: what anyone able
    to write the storage could publish, or a broken disk leave."""
    path = Path(store.ref(step).path) / MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def entry_of(name: str, key: str, value):
    def change(manifest):
        manifest["files"][name][key] = value
    return change


def meta_of(key: str, value):
    def change(manifest):
        manifest["meta"][key] = value
    return change


def file_and_folder(manifest):  # "b" listed as "a/b", beside the file "a"
    manifest["files"]["a/b"] = manifest["files"].pop("b")


CRAFTED = {
    "a file and a folder of one name": (file_and_folder, "'a/b' under 'a', which is a file too"),
    "negative size": (entry_of("a", "bytes", -1), "no plausible size (-1"),
    "size not whole": (entry_of("a", "bytes", 5.0), "no plausible size (5.0"),
    "size true": (entry_of("a", "bytes", True), "no plausible size (True"),
    "absurd size": (entry_of("a", "bytes", 1 << 60), "no plausible size"),
    "sha256 not hex": (entry_of("a", "sha256", "z" * 64), "has no sha256"),
    "rank not a number": (entry_of("a", "rank", "0"), "names no rank"),
    "sequence not a number": (lambda m: m.update(sequence="9"), "sequence is '9'"),
    "meta not an object": (lambda m: m.update(meta=["x"]), "meta is not an object"),
    "data position not an object": (meta_of("data", "next_step=100"),
                                    "data position (meta.data) is not an object"),
    "data position wrongly typed": (meta_of("data", {"next_step": "100"}), "next_step='100'"),
    "data position half a batch order": (meta_of("data", {"num_rows": 100, "next_step": 1}),
                                         "num_rows and global_batch without the other"),
    "streamed position without its data summary": (
        meta_of("data", {"streamed": True, "next_step": 100}), "no summary of the data"),
    "data summary listing files badly": (
        meta_of("data", {"streamed": True, "next_step": 100,
                         "manifest": {"digest": "d", "rows": 5, "files": {"x.parquet": 7}}}),
        "lists its data files badly"),
}


@pytest.mark.parametrize("case", CRAFTED)
def test_a_crafted_manifest_is_corrupt_and_the_older_checkpoint_is_used(any_store, tmp_path, case):
    """Each is set aside as corrupt with a warning naming the checkpoint and why; the run
    resumes from the older one. Before: a file and a folder of one name, or an absurd size in
    an object store, stopped the run as an unreachable store ("fix the disk"); a malformed data
    position or meta was taken, and failed later in the driver or a worker as a traceback."""
    change, why = CRAFTED[case]
    any_store.save(10, {"a": b"good", "b": b"older"}, {"data": {"next_step": 10}})
    any_store.save(20, {"a": b"newer", "b": b"other"}, {"data": {"next_step": 20}})
    rewrite_manifest(any_store, 20, change)
    skipped: list[str] = []
    ref, files, meta = load_newest_intact(any_store, tmp_path, skipped)
    assert ref.step == 10 and files == {"a": b"good", "b": b"older"}
    assert len(skipped) == 1 and f"{step_dir(20)}/{MANIFEST}" in skipped[0], skipped
    assert why in skipped[0], skipped


def test_a_size_larger_than_stored_is_corruption_not_a_disk_too_small(tmp_path):
    """An object store's manifest listing 8 TiB for a file of 5 bytes: the download's disk
    check took it for a cache disk too small, and the run stopped ("fix the disk")."""
    fake = object_store(tmp_path)
    fake.save(10, {"a": b"good"})
    fake.save(20, {"a": b"newer"})
    rewrite_manifest(fake, 20, entry_of("a", "bytes", 8 << 40))
    skipped: list[str] = []
    assert load_newest_intact(fake, tmp_path, skipped)[0].step == 10
    assert "a is missing or has the wrong size (5 bytes stored, 8796093022208 listed)" in skipped[0]


@pytest.mark.parametrize("content", ["oversized", "nested deep"])
def test_a_manifest_too_large_or_too_deep_to_read_is_corrupt(any_store, tmp_path, content):
    """A manifest over 64 MiB is refused unread (it was read whole into memory: a planted one
    of many GiB took the worker's memory); one nested deeper than Python parses raised a
    RecursionError, a traceback, not corruption."""
    any_store.save(10, {"a": b"good"})
    any_store.save(20, {"a": b"newer"})
    path = Path(any_store.ref(20).path) / MANIFEST
    if content == "oversized":  # valid JSON, padded: read whole, it passed every check
        with path.open("a") as f:
            f.write(" " * (64 << 20))
        why = "more than the 67108864 it may"
    else:
        path.write_text("[" * 200_000 + "]" * 200_000)
        why = "is not JSON"
    skipped: list[str] = []
    ref, files, _ = load_newest_intact(any_store, tmp_path, skipped)
    assert ref.step == 10 and files == {"a": b"good"}
    assert why in skipped[0], skipped
    assert any_store.commit_order(any_store.ref(20))[0] == -1  # retention: it goes first


def test_the_driver_reads_past_a_malformed_data_position(store):
    """The run plan takes the data position of the newest checkpoint the workers would take:
    a malformed one reached the data's plan (a KeyError there, or a wrong order)."""
    from orchestrator.driver.run_plan import newest_meta

    store.save(100, {"m": b"1"}, {"data": {"next_step": 100}, "data_files": {"a": "0" * 64}})
    store.save(200, {"m": b"2"}, {"data": {"streamed": True, "next_step": 200}})
    store.save(300, {"m": b"3"}, {"data_files": {"a": "not a digest"}})
    step, meta = newest_meta(store, store.committed())
    assert (step, meta["data"], meta["data_files"]) == (100, {"next_step": 100}, {"a": "0" * 64})


@pytest.mark.parametrize("record, why", [
    ("[]", "is not a JSON object"),
    ('{"failed": 5, "files": {}}', "its failure is not a message"),
    ('{"save_s": "slow", "files": {}}', "save_s is 'slow'"),
])
def test_a_malformed_part_record_is_named_as_corrupt(store, record, why):
    part = Path(store.ref(10).path) / PARTS / "att-rank_00000.json"
    part.parent.mkdir(parents=True)
    part.write_text(record)
    with pytest.raises(CorruptCheckpoint, match="att-rank_00000.json") as refused:
        store.wait_for_parts(10, "att", 1, Backoff(deadline_s=1))
    assert why in str(refused.value)


def copy_elsewhere(folder: Path, where: Path) -> Path:
    shutil.copytree(folder, where)
    return where


@pytest.mark.parametrize("linked", ["file", "folder", "manifest"])
def test_a_link_in_a_local_checkpoint_is_refused(store, tmp_path, linked):
    """A symbolic link where a checkpoint's file, folder or manifest should be, pointing at a
    copy with the very content listed (size and hash match): it was followed, and the run read
    whatever it pointed at. Now the checkpoint is corrupt, named with why."""
    store.save(10, {"a": b"good"})
    store.save(20, {"a": b"newer"})
    step = tmp_path / "run" / step_dir(20)
    place = {"file": Path(stored_path(step, "a")), "folder": step / "single",
             "manifest": step / MANIFEST}[linked]
    outside = copy_elsewhere(place, tmp_path / "outside") if place.is_dir() else tmp_path / "outside"
    if not place.is_dir():
        shutil.copyfile(place, outside)
        place.unlink()
    else:
        shutil.rmtree(place)
    place.symlink_to(outside)
    skipped: list[str] = []
    ref, files, _ = load_newest_intact(store, tmp_path, skipped)
    assert ref.step == 10 and files == {"a": b"good"}
    assert "is a symbolic link" in skipped[0] and step_dir(20) in skipped[0], skipped
    with pytest.raises(CorruptCheckpoint, match="symbolic link"):
        store.load(store.ref(20))


def test_a_linked_step_folder_is_not_a_checkpoint(store, tmp_path):
    """step_30 -> a committed checkpoint's folder elsewhere: not taken, not written through."""
    store.save(10, {"a": b"good"})
    store.save(20, {"a": b"newer"})
    elsewhere = copy_elsewhere(tmp_path / "run" / step_dir(20), tmp_path / "elsewhere")
    (tmp_path / "run" / step_dir(30)).symlink_to(elsewhere)
    assert [r.step for r in store.committed()] == [10, 20] and not store.is_committed(30)
    assert load_newest_intact(store, tmp_path)[0].step == 20
    with pytest.raises(CorruptCheckpoint, match="never written through one"):
        store.save(30, {"a": b"30"})
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted([MANIFEST, PARTS, "single"])


def test_every_rank_checks_the_hash_of_what_it_restores(store, tmp_path):
    """A rank other than 0 restored a local store's files by their size only (rank 0 had
    checked the same files' hashes, but they can change since): a file rewritten with other
    bytes of the same size was loaded."""
    for rank in (1, 0):
        Committer(store, rank, 2, "att", asynchronous=False).snapshot(
            10, rank_folder(tmp_path / "w", rank, {f"rank{rank}.bin": b"%d" % rank * 100}), {})
    ref, _ = store.newest_intact(tmp_path / "rank0")  # rank 0 chose it, intact
    Path(stored_path(Path(ref.path), "rank1.bin")).write_bytes(b"x" * 100)  # the same size
    with pytest.raises(CorruptCheckpoint, match="rank1.bin does not match its manifest"):
        # as worker_api.restore() calls it on a rank other than 0 of a local store
        store.fetch_loaded(ref, tmp_path / "rank1", matching("rank1.bin"))
    assert not (tmp_path / "rank1" / step_dir(10) / "rank1.bin").exists()


class RecordingDeletions:
    """The store's filesystem, its deletions noted in ``events``."""

    def __init__(self, fs, events: list):
        self.fs, self.events = fs, events

    def delete_file(self, path):
        self.events.append(("delete", os.path.realpath(path)))
        return self.fs.delete_file(path)

    def delete_dir(self, path):
        self.events.append(("delete", os.path.realpath(path)))
        return self.fs.delete_dir(path)

    def __getattr__(self, name):
        return getattr(self.fs, name)


def record_syncs_and_renames(monkeypatch, events: list) -> None:
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    def replace(src, dst, **options):
        events.append(("rename", os.path.realpath(dst)))
        return real_replace(src, dst, **options)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)


def test_a_local_commit_is_on_disk_before_it_shows_and_before_retention_deletes(
        store, tmp_path, monkeypatch):
    """A power loss after the manifest's rename must not leave a committed checkpoint whose
    files, part records or folders were still in memory, with retention having deleted the
    older ones: nothing was fsync'ed. Now every file once, the part record, every folder and
    the manifest are, before the rename; the rename before retention deletes."""
    store.save(10, {"a": b"old"})
    events: list = []
    record_syncs_and_renames(monkeypatch, events)
    store.fs = RecordingDeletions(store.fs, events)
    store.save(20, {"a": b"new", "sub/b": b"nested"})
    assert store.prune(keep=1) == [10]
    root = Path(os.path.realpath(tmp_path / "run"))
    step = root / step_dir(20)
    commit = events.index(("rename", str(step / MANIFEST)))
    synced = [path for kind, path in events[:commit] if kind == "fsync"]
    files = [stored_path(step, "a"), stored_path(step, "sub/b")]
    for path in [*files, str(step / "single" / "sub"), str(step / "single"), str(step / PARTS),
                 str(step), str(root), str(root.parent)]:
        assert path in synced, (path, synced)
    assert all(synced.count(path) == 1 for path in files)  # once a file, not per chunk
    for record in (step / PARTS / "single-rank_00000.json", step / MANIFEST):
        assert any(path.startswith(f"{record}.tmp") for path in synced), (record, synced)
    deleted = events.index(("delete", str(root / step_dir(10) / MANIFEST)))
    assert ("fsync", str(step)) in events[commit:deleted]


def test_an_object_store_is_never_fsynced(tmp_path, monkeypatch):
    events: list = []
    record_syncs_and_renames(monkeypatch, events)
    object_store(tmp_path).save(10, {"a": b"x"})
    assert not [e for e in events if e[0] == "fsync"]
