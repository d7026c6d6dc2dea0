"""Checkpoints in real S3 (SeaweedFS on loopback): commit, partial, corrupt, retention,
outage, bad input, secrets, and a round trip through every trainer on real Ray."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.checkpoint.cleanup import remove_stale
from orchestrator.checkpoint.committer import Committer
from orchestrator.checkpoint.retry import Backoff
from orchestrator.checkpoint.store import MANIFEST, CheckpointStore, CheckpointUnreachable, step_dir
from orchestrator.storage.location import Credentials, StorageSpec
from tests.conftest import REPO, CliBatch, cli_command, cli_env, free_port, run_cli
from tests.helpers import (
    assert_input_error,
    assert_planted_one_refused,
    bad_names,
    load_newest_intact,
    plant_manifest,
    rank_folder,
    stored_path,
)


def spec_for(server, prefix: str, create_bucket: bool = True) -> StorageSpec:
    return StorageSpec(f"s3://ckpt-tests/{prefix}", server.endpoint, "us-east-1",
                       Credentials(server.access_key, server.secret_key), create_bucket)


def s3_env(server) -> dict:
    return {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}


def test_commit_and_load_round_trip(s3_server, bucket, tmp_path):
    store = CheckpointStore(spec_for(s3_server, "roundtrip"))
    store.save(10, {"model.pt": b"m" * 1000, "opt.pt": b"o" * 10})
    ref, files, _ = load_newest_intact(store, tmp_path)
    assert ref.step == 10 and ref.uri == "s3://ckpt-tests/roundtrip/step_000000010"
    assert files == {"model.pt": b"m" * 1000, "opt.pt": b"o" * 10}


def test_a_partial_upload_is_never_the_latest(s3_server, bucket):
    store = CheckpointStore(spec_for(s3_server, "partial"))
    store.save(10, {"a": b"whole"})
    fs = s3_server.filesystem()
    with fs.open_output_stream(f"ckpt-tests/partial/{step_dir(20)}/a") as f:
        f.write(b"half of it")  # files uploaded, manifest not yet written
    assert [r.step for r in store.committed()] == [10]


def test_a_folder_name_an_object_store_keeps_after_its_last_object_is_no_warning(
        s3_server, bucket, caplog):
    """SeaweedFS lists a step folder whose objects are gone (emptied by retention) and then
    says it does not exist when it is removed: there is nothing to clean, and every S3 run
    warned 'cleaning .../step_...: [Errno 2] Path does not exist'."""
    import logging

    from orchestrator.checkpoint.cleanup import remove_stale

    store = CheckpointStore(spec_for(s3_server, "emptied"))
    for step in (10, 20, 30):
        store.save(step, {"a": b"%d" % step})
    fs = s3_server.filesystem()
    failed = f"ckpt-tests/emptied/{step_dir(15)}"
    with fs.open_output_stream(f"{failed}/a") as f:
        f.write(b"half")  # a failed write's leftover
    fs.delete_file(f"{failed}/a")
    store.prune(keep=1, protect=set())  # retention empties steps 10 and 20
    with caplog.at_level(logging.WARNING):
        remove_stale(store)
    assert not [r for r in caplog.records if "cleaning" in r.getMessage()], caplog.text
    assert [r.step for r in store.committed()] == [30]


def test_a_corrupt_object_is_reported_and_the_older_checkpoint_used(s3_server, bucket, tmp_path):
    store = CheckpointStore(spec_for(s3_server, "corrupt"))
    store.save(10, {"a": b"good"})
    store.save(20, {"a": b"newer"})
    fs = s3_server.filesystem()
    with fs.open_output_stream(stored_path(f"ckpt-tests/corrupt/{step_dir(20)}", "a", fs)) as f:
        f.write(b"rot!!")  # same size, other bytes: only the checksum can tell
    skipped: list[str] = []
    ref, files, _ = load_newest_intact(store, tmp_path, skipped)
    assert ref.step == 10 and files["a"] == b"good"
    assert len(skipped) == 1 and "step_000000020" in skipped[0]


def test_a_corrupt_checkpoint_set_aside_is_written_again(s3_server, bucket, tmp_path):
    """Its manifest moved aside (an object store's move: copy, then delete), the step is no
    longer committed, and a new save of it commits."""
    store = CheckpointStore(spec_for(s3_server, "aside"))
    store.save(10, {"a": b"good"})
    store.save(20, {"a": b"newer"})
    fs = s3_server.filesystem()
    with fs.open_output_stream(stored_path(f"ckpt-tests/aside/{step_dir(20)}", "a", fs)) as f:
        f.write(b"rot!!")
    corrupt: list = []
    ref, _ = store.newest_intact(tmp_path / "cache", [], corrupt)
    assert ref.step == 10 and [r.step for r in corrupt] == [20]
    assert store.set_aside(corrupt[0]).endswith(".json") and not store.is_committed(20)
    store.save(20, {"a": b"again"})
    assert store.load(store.ref(20))[0] == {"a": b"again"}


@pytest.mark.parametrize("kind", ["absolute", "dotdot"])
def test_a_planted_manifest_writes_nothing_outside_the_download_folder(s3_server, bucket, tmp_path,
                                                                       kind):
    """A newer checkpoint planted in the bucket, listing a file named to land outside the
    download folder: refused as corrupt, the older one used, nothing written outside."""
    store = CheckpointStore(spec_for(s3_server, f"planted-{kind}"))
    name = bad_names(tmp_path)[kind]
    store.save(10, {"a": b"good"})
    plant_manifest(store, 20, name)
    assert_planted_one_refused(store, tmp_path, name)


def test_retention_keeps_the_newest_and_the_one_being_resumed(s3_server, bucket):
    store = CheckpointStore(spec_for(s3_server, "retention"))
    for step in (10, 20, 30, 40, 50):
        store.save(step, {"a": str(step).encode()})
    store.prune(keep=2, protect={20})
    assert [r.step for r in store.committed()] == [20, 40, 50]
    info = s3_server.filesystem().get_file_info(f"ckpt-tests/retention/{step_dir(10)}/{MANIFEST}")
    assert info.type.name == "NotFound"


def test_an_upload_outlives_a_server_outage_without_blocking_training(s3_server, bucket, tmp_path):
    store = CheckpointStore(spec_for(s3_server, "outage"))
    committer = Committer(store, asynchronous=True, backoff=Backoff(first_s=0.5, max_s=2.0, deadline_s=120))
    big = secrets.token_bytes(96 << 20)  # long enough to be cut off mid-upload
    ten, twenty = (rank_folder(tmp_path / str(s), 0, {"model.bin": d}) for s, d in ((10, big), (20, big[:1000])))
    blocked = [committer.snapshot(10, ten, {"step": 10})]
    time.sleep(0.3)
    s3_server.stop(kill=True)  # the outage starts while step 10 uploads
    blocked.append(committer.snapshot(20, twenty, {"step": 20}))
    time.sleep(3)
    assert committer.committed_steps == []  # nothing can be committed while the server is down
    s3_server.restart()
    committer.close()  # waits until the retries have committed both
    assert max(blocked) < 2.0, f"a step was blocked {blocked} s by the upload"
    assert committer.committed_steps == [10, 20]
    ref, files, _ = load_newest_intact(store, tmp_path)
    assert ref.step == 20
    assert store.load(store.committed()[0])[0]["model.bin"] == big  # whole and verified


def test_a_checkpoint_unreachable_at_start_stops_the_start_instead_of_starting_over(
        s3_server, bucket, tmp_path):
    """Issue 26, 1: the server down, or a cache disk too small, is not corruption. Falling
    back to older checkpoints would fail alike and end in a silent step 0; instead the start
    stops, naming the checkpoint and the cause, after the outage's retries."""
    store = CheckpointStore(spec_for(s3_server, "unreachable"))
    store.save(10, {"model.bin": b"older"})
    store.save(20, {"model.bin": secrets.token_bytes(3 << 20)})
    quick = Backoff(first_s=0.2, max_s=0.5, deadline_s=2)

    cache = tmp_path / "small"  # a real disk of 1 MiB: the 3 MiB checkpoint cannot fit
    cache.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(cache)], check=True)
    try:
        with pytest.raises(CheckpointUnreachable, match=r"step_000000020 could not be read \("
                           r"\d+ bytes needed in .*small.*free\)"):
            store.newest_intact(cache, backoff=quick)
        assert list(cache.iterdir()) == []  # nothing half-downloaded left
    finally:
        subprocess.run(["umount", str(cache)], check=True)

    s3_server.stop(kill=True)
    # A killed weed leaves its Unix sockets in /tmp; the helper removes its own (and its
    # logs go to its data folder).
    assert not [p for p in Path("/tmp").glob("seaweedfs-*.sock")
                if any(str(port) in p.name for port in (s3_server.s3_port, *s3_server.ports.values()))]
    try:
        skipped: list[str] = []
        with pytest.raises(CheckpointUnreachable, match="could not be (read|listed)") as raised:
            store.newest_intact(tmp_path / "cache", skipped, backoff=quick)
        assert skipped == [] and "run the same command again" in str(raised.value)
    finally:
        s3_server.restart()
    ref, files, _ = load_newest_intact(store, tmp_path)  # back up: the newest is read
    assert ref.step == 20 and len(files["model.bin"]) == 3 << 20


def test_credentials_from_the_aws_chain_are_read_again_when_refused(
        s3_server, bucket, tmp_path, monkeypatch):
    """Issue 26, 3: no keys in the environment, a profile's credentials file instead (as SSO or
    an assumed role leave it). The key expires mid-run and the file is rewritten with a new
    one: the next upload is refused once, the store opens its connection again, and the
    checkpoint commits with the new key. Without the reopening the SDK keeps the refused key
    for minutes (it rereads a profile every 5), far past this retry budget."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    profile = tmp_path / "credentials"

    def key(n: int) -> tuple[str, str]:
        access, secret = f"ROTATING{n}{secrets.token_hex(4)}", secrets.token_hex(20)
        s3_server.grant("rotating", access, secret)
        profile.write_text(f"[ckpt]\naws_access_key_id = {access}\n"
                           f"aws_secret_access_key = {secret}\n")
        return access, secret

    first = key(1)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(profile))
    monkeypatch.setenv("AWS_PROFILE", "ckpt")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    spec = StorageSpec("s3://ckpt-tests/rotating", s3_server.endpoint, "us-east-1", None)
    store = CheckpointStore(spec)
    committer = Committer(store, asynchronous=False, backoff=Backoff(0.2, 0.5, deadline_s=10))
    committer.snapshot(10, rank_folder(tmp_path / "10", 0, {"model.bin": b"one"}), {"step": 10})
    s3_server.revoke("rotating", first[0])
    key(2)
    committer.snapshot(20, rank_folder(tmp_path / "20", 0, {"model.bin": b"two"}), {"step": 20})
    committer.close()
    assert committer.committed_steps == [10, 20]
    ref, files, _ = load_newest_intact(store, tmp_path)
    assert ref.step == 20 and files == {"model.bin": b"two"}


# -- bad input: one line, exit 2, before any worker starts, nothing written ------------------

MALFORMED = ["s3://Bad_Bucket/x", "s3:///nobucket", "s3://ab/x"]


@pytest.fixture(scope="module")
def bad_s3_input(tmp_path_factory, s3_server):
    """The cases with the server's own credentials, side by side."""
    endpoint = f"storage.endpoint={s3_server.endpoint}"
    cases = {"unreachable": ["storage.uri=s3://ckpt-tests/x",
                             f"storage.endpoint=http://127.0.0.1:{free_port()}"],
             "no-bucket": ["storage.uri=s3://no-such-bucket/x", endpoint, "storage.create_bucket=false"],
             **{uri: [f"storage.uri={uri}", endpoint] for uri in MALFORMED}}
    return CliBatch(tmp_path_factory.mktemp("bad-s3"), {k: ["storage=s3", *v] for k, v in cases.items()},
                    env=s3_env(s3_server), local_storage=False)


def test_cli_unreachable_endpoint(bad_s3_input):
    assert_input_error(bad_s3_input.result("unreachable"), "storage.endpoint")


def test_cli_wrong_credentials(tmp_path, s3_server, bucket):
    env = {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": "wrong" + "x" * 30}
    result = run_cli(tmp_path / "run", "storage=s3", "storage.uri=s3://ckpt-tests/wrongcreds",
                     f"storage.endpoint={s3_server.endpoint}", env=env, timeout=120)
    assert_input_error(result, "credentials")
    assert "wrongxxx" not in result.output


def test_cli_missing_bucket_when_creation_is_off(bad_s3_input, s3_server):
    assert_input_error(bad_s3_input.result("no-bucket"), "no-such-bucket")
    assert "no-such-bucket" not in [i.base_name for i in s3_server.filesystem().get_file_info(
        __import__("pyarrow.fs", fromlist=["FileSelector"]).FileSelector(""))]


@pytest.mark.parametrize("uri", MALFORMED)
def test_cli_malformed_uri(bad_s3_input, uri):
    assert_input_error(bad_s3_input.result(uri), "storage.uri")


# -- the training functions on real Ray, checkpointing to S3 (the built-in trainers: see
# tests/test_trainers_e2e.py) ----------------------------------------------------------------

def test_a_final_checkpoint_lost_to_an_outage_fails_the_run_at_once(
        ray_head, s3_server, bucket, tmp_path):
    """Issue 26, 5, with a real fault: the object store goes down before the run's last steps;
    training ends, and its final checkpoint cannot be committed within checkpoint.upload_retry_s:
    the run exits 1 naming it, never 'succeeded' over a lost checkpoint, and at once (a restart
    would train the lost steps again only to meet the same store). The newest committed
    checkpoint is the one the same command resumes from."""
    from tests.conftest import read_record, start_run, wait_for

    gate = tmp_path / "gate"
    gate.write_text("hold")
    proc = start_run(tmp_path / "lost", f"cluster.address={ray_head.address}", "storage=s3",
                     "storage.uri=s3://ckpt-tests/lost-final", f"storage.endpoint={s3_server.endpoint}",
                     "run.name=lost", "trainer.max_steps=60", "checkpoint.every_steps=20",
                     "checkpoint.upload_retry_s=3", "cluster.cpus_per_worker=0.5",
                     "trainer.fn=tests.user_trainers:gated_ddp", f"+trainer.gate={gate}",
                     "+trainer.hold_at=50", env=s3_env(s3_server))
    try:  # held at step 50 once step 40 is committed: then the store goes down
        wait_for(lambda r: 40 in [c["step"] for c in r.get("checkpoints", [])], tmp_path / "lost")
        s3_server.stop(kill=True)
        gate.unlink()
        out, _ = proc.communicate(timeout=300)
    finally:
        gate.unlink(missing_ok=True)
        s3_server.restart()
    rec = read_record(tmp_path / "lost")
    assert proc.returncode == 1, out[-4000:]
    assert rec["status"] == "failed" and rec["restarts"] == 0 and rec["steps"] == 60, rec
    assert "the checkpoint at step 60 was not committed" in out, out[-4000:]
    assert "CheckpointNotCommitted is not retried" in json.dumps(rec), rec.get("failures")
    store = CheckpointStore(spec_for(s3_server, "lost-final/lost"))
    assert store.latest().step == 40  # where the same command goes on from


def sharded_state(store: CheckpointStore, tmp_path, name: str) -> dict:
    """The newest checkpoint's FSDP shards (model and optimizer), downloaded and joined by
    DCP itself, flattened to {"model.0.weight": tensor, "optimizer.state.0.weight.exp_avg": ...}."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = store.fetch(store.latest(), tmp_path / name)
    dcp_to_torch_save(folder / "dcp", tmp_path / f"{name}.pt")
    flat = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            flat[prefix] = value

    walk("", torch.load(tmp_path / f"{name}.pt", weights_only=False))
    return flat


def test_fsdp_shards_survive_a_rank_killed_mid_upload_and_resume_bit_identical(
        ray_head, s3_server, bucket, tmp_path):
    """FSDP on 2 workers, each rank's shard of a 17M-parameter MLP (~68 MB with momentum)
    written in the background (DCP's async_save) and uploaded to S3: rank 1 killed once its
    shard of step 20 is being written out for the upload, so step 20 is never the
    latest and the restart resumes from step 10 and commits step 20 again, whole; the run then
    ends with the same parameters, bit for bit, as one that was never interrupted."""
    import glob
    import os
    import signal

    from tests.conftest import finish_run, read_record, start_run

    common = ["trainer=fsdp", f"cluster.address={ray_head.address}", "storage=s3",
              "storage.uri=s3://ckpt-tests/fsdp", f"storage.endpoint={s3_server.endpoint}",
              "trainer.model.hidden=[4096,4096]", "trainer.max_steps=20",
              "checkpoint.every_steps=10", "checkpoint.keep=0", "cluster.cpus_per_worker=0.5"]
    pattern = "/tmp/orchestrator-rank1-*/staging/step_000000020/dcp/__1_0.distcp"
    before, folders_before = set(glob.glob(pattern)), set(glob.glob("/tmp/orchestrator-rank*"))
    proc = start_run(tmp_path / "killed", *common, "run.name=killed", env=s3_env(s3_server))
    deadline = time.time() + 400
    while not set(glob.glob(pattern)) - before:
        assert proc.poll() is None, f"the run ended ({proc.returncode}): {proc.communicate()[0][-4000:]}"
        assert time.time() < deadline, f"no shard of step 20 in 400 s: {read_record(tmp_path / 'killed')}"
        time.sleep(0.02)
    rank1 = next(w["pid"] for w in read_record(tmp_path / "killed")["workers"] if w["rank"] == 1)
    os.kill(rank1, signal.SIGKILL)  # its shard of step 20 written locally, being uploaded
    # The uninterrupted run goes alongside the restart (each takes half the head's CPUs).
    straight = start_run(tmp_path / "straight", *common, "run.name=straight", env=s3_env(s3_server))
    store = CheckpointStore(spec_for(s3_server, "fsdp/killed"))
    time.sleep(2)
    assert not store.is_committed(20), "a checkpoint missing rank 1's shard was committed"
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    rec = read_record(tmp_path / "killed")
    assert rec["restarts"] == 1 and [w["step"] for w in rec["world_sizes"]] == [0, 10], rec
    # Resuming, rank 0 verified the whole step-10 checkpoint; rank 1 fetched only what its
    # part of the state lies in (issue 26, 1), not every rank's shards.
    resumed_from = store.read_manifest(store.ref(10))["files"]
    fetched = {w["rank"]: w.get("restored_bytes") for w in rec["workers"]}
    assert fetched[0] == sum(e["bytes"] for e in resumed_from.values()), (fetched, resumed_from)
    assert fetched[1] == resumed_from["dcp/.metadata"]["bytes"] + \
        resumed_from["dcp/__1_0.distcp"]["bytes"], (fetched, resumed_from)
    # The step waited only for the in-memory copy: the upload waited for the files after it.
    assert any(c["write_s"] > 0 for c in rec["checkpoints"]), rec["checkpoints"]
    manifest = store.read_manifest(store.latest())
    assert {n: e["rank"] for n, e in manifest["files"].items()} == {
        "dcp/.metadata": 0, "dcp/__0_0.distcp": 0, "dcp/__1_0.distcp": 1}
    assert min(e["bytes"] for n, e in manifest["files"].items() if n.endswith(".distcp")) > 60 << 20
    assert unfinished_uploads(s3_server, "fsdp/killed") == []  # the killed rank's, if any: aborted

    straight = finish_run(straight, tmp_path / "straight")
    assert straight.returncode == 0, straight.output[-4000:]
    # The node's disk: the killed rank's staged shard of step 20 (and the folders of the rank
    # torn down with it) removed by the next workers to start or end there.
    assert set(glob.glob("/tmp/orchestrator-rank*")) - folders_before == set()
    a = sharded_state(store, tmp_path, "killed")
    b = sharded_state(CheckpointStore(spec_for(s3_server, "fsdp/straight")), tmp_path, "straight")
    assert a.keys() == b.keys() and any(k.startswith("optimizer.state") for k in a)
    differ = [k for k in a if not (a[k].equal(b[k]) if hasattr(a[k], "equal") else a[k] == b[k])]
    assert not differ, f"the resumed run's shards differ: {differ[:5]}"


def unfinished_uploads(server, prefix: str) -> list[str]:
    from orchestrator.storage.multipart import s3_client

    listed = s3_client(spec_for(server, prefix)).list_multipart_uploads(
        Bucket="ckpt-tests", Prefix=f"{prefix}/")
    return [u["Key"] for u in listed.get("Uploads", [])]


def test_an_upload_left_unfinished_by_a_killed_writer_is_aborted_at_the_next_start(
        s3_server, bucket):
    """Issue 26, 10: a writer killed mid-upload (pyarrow's multipart stream, a part sent, the
    process gone without closing it) leaves an upload the store keeps and bills; the cleaning
    at a worker group's start (and at a run's end) aborts the run's own, not a sibling run's."""
    code = f"""
import os, pyarrow.fs as pafs
fs = pafs.S3FileSystem(endpoint_override={s3_server.endpoint!r}, scheme="http",
                       access_key={s3_server.access_key!r}, secret_key={s3_server.secret_key!r})
streams = []  # held: a stream dropped is closed by pyarrow
for run in ("leftover", "leftover2"):
    streams.append(fs.open_output_stream(f"ckpt-tests/{{run}}/step_000000020/att-x/shard.bin"))
    streams[-1].write(b"x" * (30 << 20))  # past the size pyarrow sends in one PUT
    streams[-1].flush()  # a part sent: the multipart upload exists on the store
os._exit(0)  # killed: never closed, never aborted
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    store = CheckpointStore(spec_for(s3_server, "leftover"))
    store.save(10, {"a": b"kept"})
    assert unfinished_uploads(s3_server, "leftover") == ["leftover/step_000000020/att-x/shard.bin"]
    removed = remove_stale(store)
    assert "leftover/step_000000020/att-x/shard.bin" in removed
    assert unfinished_uploads(s3_server, "leftover") == []
    assert unfinished_uploads(s3_server, "leftover2") == ["leftover2/step_000000020/att-x/shard.bin"]
    assert [r.step for r in store.committed()] == [10]


def test_cli_no_credentials_anywhere_says_so(tmp_path, s3_server, bucket):
    """No keys in the environment, no profile file, no role: the chain found nothing (as in a
    job submitted from a shell whose keys the cluster never sees); the line said the chain
    'refuses the credentials' it had found."""
    env = {k: v for k, v in cli_env().items() if not k.startswith("AWS_")}
    env.update(HOME=str(tmp_path), AWS_EC2_METADATA_DISABLED="true")
    proc = subprocess.run(cli_command(tmp_path / "run", "storage=s3", "storage.uri=s3://ckpt-tests/x",
                                      f"storage.endpoint={s3_server.endpoint}"),
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().startswith(
        f"error: storage: {s3_server.endpoint} refuses the request: this machine has no AWS "
        "credentials (no AWS_ACCESS_KEY_ID, no profile file"), proc.stderr
    assert "ray job submit" in proc.stderr


def test_data_in_s3_is_judged_by_content_and_its_csv_is_converted_beside_the_runs(
        s3_server, bucket, tmp_path, monkeypatch):
    """Issue 61, 1 and 6 on a real S3 server: an object rewritten with the same size (every
    label flipped) is a changed file, one written again with the same bytes is not; a CSV
    there becomes one parquet copy in the storage's _data/, made once."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    from orchestrator.data.fingerprint import data_fingerprint, what_changed
    from orchestrator.data.manifest import list_files
    from orchestrator.data.text_data import converted

    monkeypatch.setenv("ORCHESTRATOR_PRIVATE_DIR", str(tmp_path / "private"))
    data = spec_for(s3_server, "data-fingerprint")
    fs, root = data.filesystem()

    def put(name: str, text: str) -> None:
        with fs.open_output_stream(f"{root}/{name}") as f:
            f.write(text.encode())

    def digests() -> dict:
        return data_fingerprint(data, list_files(fs, root, "data.path"), "data.path")

    put("a.csv", "x,label\n1,0\n2,1\n")
    put("b.csv", "x,label\n3,1\n")
    before = digests()
    put("b.csv", "x,label\n3,1\n")  # the same bytes again: a new modification time only
    assert what_changed(before, digests()) is None
    put("a.csv", "x,label\n1,1\n2,0\n")  # the same size, labels flipped
    assert what_changed(before, digests()) == f"1 file rewritten ({root}/a.csv)"

    storage = spec_for(s3_server, "csv-runs")
    copy = converted(data, storage, "label", "data.path")
    assert copy.startswith("s3://ckpt-tests/csv-runs/_data/data-fingerprint-")
    copy_fs, copy_path = storage.sibling(copy).filesystem()
    table = pq.read_table(copy_path, filesystem=copy_fs)
    assert sorted(table.column("x").to_pylist()) == [1.0, 2.0, 3.0]
    assert converted(data, storage, "label", "data.path") == copy
    assert [i.base_name for i in copy_fs.get_file_info(pafs.FileSelector(copy_path))
            if i.base_name.endswith(".parquet")] == ["part-00000.parquet", "part-00001.parquet"]
