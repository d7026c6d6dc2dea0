"""Checkpoint commit, discovery, corruption and retention on a local directory."""

from __future__ import annotations

import json

import pytest

from orchestrator.checkpoint.policy import CheckpointPolicy
from orchestrator.checkpoint.store import MANIFEST, CheckpointStore, open_source, step_dir
from orchestrator.storage import StorageSpec


@pytest.fixture
def store(tmp_path):
    return CheckpointStore(StorageSpec(str(tmp_path / "run")))


def test_a_checkpoint_is_committed_by_its_manifest(store, tmp_path):
    saved = store.save(10, {"model.pt": b"abc", "optimizer.pt": b"xyz"}, {"step": 10})
    assert saved.bytes == 6 and saved.ref.step == 10
    manifest = json.loads((tmp_path / "run" / step_dir(10) / MANIFEST).read_text())
    assert manifest["files"]["model.pt"]["bytes"] == 3
    ref, files, meta = store.load_newest_intact()
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
    (tmp_path / "run" / step_dir(20) / "a").write_bytes(b"rot!!")
    ref, files, _ = store.load_newest_intact()
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


def test_resume_source_is_a_checkpoint_or_a_run_folder(store, tmp_path):
    store.save(10, {"a": b"1"})
    store.save(20, {"a": b"2"})
    run = StorageSpec(str(tmp_path / "run"))
    assert open_source(run)[1].step == 20
    assert open_source(run.child(step_dir(10)))[1].step == 10
    assert open_source(StorageSpec(str(tmp_path / "elsewhere"))) is None


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
    decisions = []
    for step, now in events:
        decision = policy.should_save(step, now)
        if decision:
            policy.saved(step, now)
        decisions.append(decision)
    assert decisions == expected
