"""Storage rules without Ray: the storage kind must match its URI, and the decisions and
checks behind "every node must see the checkpoints" (orchestrator/storage/probe.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orchestrator.cli import CONF_DIR
from orchestrator.config.preflight import check_command_line
from orchestrator.errors import ConfigError
from orchestrator.storage.location import StorageSpec
from orchestrator.storage.probe import (
    MARKER,
    PROBE_PREFIX,
    StorageMarker,
    StorageNotShared,
    check_cluster_storage,
    check_worker_node,
    judge,
    leave_marker,
    probe_path,
    reads_back,
)
from tests.conftest import REPO, free_port, run_cli
from tests.helpers import assert_input_error


@pytest.mark.parametrize("overrides, allowed", [
    (["storage=s3", "storage.uri=not-a-uri"], "with storage=s3, an s3://bucket/prefix URI"),
    (["storage=s3"], "with storage=s3"),  # the group's uri is required, not ./checkpoints
    (["storage=s3", "storage.uri=/data/ckpt"], "with storage=s3"),
    (["storage=s3", "storage.uri=gs://bucket/x"], "with storage=s3"),
    (["storage.uri=s3://bucket/x"], "with storage=local, a directory"),
])
def test_the_storage_kind_must_match_the_uri(overrides, allowed):
    with pytest.raises(ConfigError) as err:
        check_command_line(overrides, CONF_DIR)
    assert "storage.uri=" in str(err.value) and allowed in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides", [
    ["storage=s3", "storage.uri=s3://bucket/prefix"],
    ["storage.uri=/data/ckpt"],
    ["storage.uri=file:///data/ckpt"],
    ["storage.uri=relative/dir"],
])
def test_matching_kinds_pass(overrides):
    assert check_command_line(overrides, CONF_DIR) == 1


def test_cli_storage_s3_without_an_s3_uri_writes_nothing(tmp_path):
    """The command a user with a forgotten `s3://` types: one line, exit 2, and no local
    folder named after the URI (it used to train into ./not-a-uri and exit 0)."""
    result = run_cli(tmp_path / "run", "storage=s3", "storage.uri=not-a-uri", timeout=120,
                     cwd=tmp_path, env={"PYTHONPATH": str(REPO)})
    assert_input_error(result, "storage.uri='not-a-uri'")
    assert "storage=s3" in result.stderr
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())  # no ./not-a-uri, no run dir


# -- the shared-storage decision: a pure function of the nodes' answers -----------------------

S3 = StorageSpec("s3://bucket/runs", "http://127.0.0.1:8333")
LOCAL = StorageSpec("/data/ckpt")


@pytest.mark.parametrize("storage, answers, refused", [
    (LOCAL, {"10.0.0.1": None, "10.0.0.2": None}, None),
    (LOCAL, {"10.0.0.1": None, "10.0.0.2": "no such file there"}, "storage.uri='/data/ckpt' is not shared"),
    (LOCAL, {"10.0.0.1": None, "10.0.0.2": "no answer"}, None),  # checked when it runs a worker
    (S3, {"10.0.0.1": None, "10.0.0.2": "nothing answers at http://127.0.0.1:8333"},
     "storage.endpoint='http://127.0.0.1:8333' is not reachable from 1 of 2 nodes"),
    (S3, {"10.0.0.1": None, "10.0.0.2": "another file there (not the driver's)"},
     "storage.uri='s3://bucket/runs' is not shared"),
])
def test_the_nodes_answers_decide(storage, answers, refused):
    if refused is None:
        judge(storage, len(answers), answers)
        return
    with pytest.raises(ConfigError) as err:
        judge(storage, len(answers), answers)
    message = str(err.value)
    assert refused in message and "\n" not in message
    assert "10.0.0.2" in message and "10.0.0.1" not in message  # names the nodes that differ
    if "not shared" in message:
        assert "storage=s3" in message and "same path on every node" in message


def test_the_probe_goes_in_the_nearest_existing_directory(tmp_path):
    import pyarrow.fs as pafs

    local = pafs.LocalFileSystem()
    assert probe_path(local, str(tmp_path / "a" / "b"), "p") == str(tmp_path / "p")
    assert probe_path(local, str(tmp_path), "p") == str(tmp_path / "p")
    s3 = pafs.S3FileSystem(anonymous=True, region="us-east-1")
    assert probe_path(s3, "bucket/runs/x", "p") == "bucket/runs/x/p"  # no folders to make


def test_a_worker_on_a_node_without_the_marker_stops_with_the_reason(tmp_path):
    run = StorageSpec(str(tmp_path / "ckpt" / "run"))
    marker = leave_marker(run)
    assert (tmp_path / "ckpt" / "run" / MARKER).read_bytes() == marker.content
    check_worker_node(marker)  # this "node" sees it
    check_worker_node(None)  # embedded Ray: nothing to check
    other = StorageMarker(StorageSpec(str(tmp_path / "elsewhere")), marker.content)
    with pytest.raises(StorageNotShared, match="does not see the run's storage .* no such file"):
        check_worker_node(other)
    impostor = StorageMarker(run, b"another driver's marker")
    assert reads_back(run, str(tmp_path / "ckpt" / "run" / MARKER), impostor.content) == \
        "another file there (not the driver's)"
    assert not list(tmp_path.rglob(PROBE_PREFIX + "*"))


def test_a_store_that_refuses_the_marker_is_one_line_naming_storage_uri(tmp_path):
    """The driver's marker is its first write to the run's folder: a store that refuses it
    (full, failing: SeaweedFS answers 500 on a full disk) stops the command with one line, not
    a traceback (CI found it as an exit 1 with Hydra's trace)."""
    (tmp_path / "ckpt").write_text("a file where the run's folder must go")
    with pytest.raises(ConfigError, match=r"^storage.uri='/runs': cannot write there \(.+\)$"):
        leave_marker(StorageSpec(str(tmp_path / "ckpt" / "run")), shown_uri="/runs")
    assert (tmp_path / "ckpt").read_text().startswith("a file")  # nothing touched
    # On an embedded Ray too (one machine, nothing to compare): before any worker, not at the
    # first checkpoint (a user's storage.uri=/proc/x failed twice there, exit 1 after 24 s).
    unwritable = SimpleNamespace(run_storage=StorageSpec(str(tmp_path / "ckpt" / "run")),
                                 created_bucket=False)
    with pytest.raises(ConfigError, match=r"^storage.uri='.*/ckpt': cannot write there \(.+\)$"):
        check_cluster_storage(unwritable, joined=False)
    writable = SimpleNamespace(run_storage=StorageSpec(str(tmp_path / "ok" / "run")),
                               created_bucket=False)
    assert check_cluster_storage(writable, joined=False) is None  # no worker checks its node
    assert (tmp_path / "ok" / "run" / MARKER).exists()


def test_a_worker_that_reaches_no_store_waits_out_an_outage_then_says_so(monkeypatch):
    """A store that does not answer (a restart during an outage) is not a node of its own:
    the worker waits, then stops the run (not retried) saying the store cannot be reached."""
    from orchestrator.storage import probe
    from orchestrator.storage.location import Credentials

    monkeypatch.setattr(probe, "UNREACHABLE_WAIT_S", 1.0)
    down = StorageSpec("s3://ckpt/run", f"http://127.0.0.1:{free_port()}", "us-east-1",
                       Credentials("K", "S" * 20))
    with pytest.raises(probe.StorageUnreachable,
                       match=r"storage s3://ckpt/run cannot be reached from node .* \(nothing "
                             r"answers at http://127.0.0.1:\d+, for 1 s\): the run does not"):
        check_worker_node(StorageMarker(down, b"marker"))
    assert probe.StorageUnreachable.retry is False


def test_an_object_store_that_answers_with_an_error_is_waited_out_not_called_unshared(
        monkeypatch):
    """A 503 (SlowDown) on a worker's read of the marker said "node ... does not see the run's
    storage" and, the same again after the restart, stopped the run."""
    import orchestrator.storage.probe as probe

    class Throttled:
        def open_input_stream(self, path):
            raise OSError("When reading: AWS Error SLOW_DOWN (HTTP status 503)")

    monkeypatch.setattr(probe, "_filesystem", lambda spec: (Throttled(), "bucket/run"))
    s3 = StorageSpec("s3://bucket/run", "http://127.0.0.1:8333")
    assert reads_back(s3, "bucket/run/m", b"x").startswith(probe.STORE_ERROR)
    monkeypatch.setattr(probe, "UNREACHABLE_WAIT_S", 0.0)
    monkeypatch.setattr(probe.ray.util, "get_node_ip_address", lambda: "10.0.0.2")
    with pytest.raises(probe.StorageUnreachable, match="cannot be reached from node 10.0.0.2"):
        check_worker_node(StorageMarker(s3, b"x"))


@pytest.mark.parametrize("path, says", [
    ("foo://bar/x.parquet", "is not allowed: a directory, s3://bucket/prefix or another URI"),
    ("s3://B/x", "is not allowed: s3://bucket/prefix with a bucket name")])
def test_a_data_path_pyarrow_cannot_open_names_data_path_not_storage_uri(path, says):
    from orchestrator.config.schema import DataConfig
    from orchestrator.data.datasets import check_parquet

    with pytest.raises(ConfigError, match=f"^data.path={path!r} {says}".replace("(", r"\(")):
        check_parquet(DataConfig(name="parquet", path=path), StorageSpec("/tmp/ckpt"))
