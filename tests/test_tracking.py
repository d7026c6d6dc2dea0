"""tracking=mlflow without Ray: the buffer's rules, the URI's checks, and the driver's tracker
against a real MLflow server that goes away (SIGSTOP) and comes back. The runs end to end:
tests/test_pytorch_trainer.py (killed, interrupted and resumed) and tests/test_sweep.py
(a sweep's parent and nested runs)."""

from __future__ import annotations

import logging
import time

import pytest

from orchestrator.errors import ConfigError
from orchestrator.tracking.mlflow_open import flat_params
from orchestrator.tracking.points import PointBuffer
from orchestrator.tracking.uri import absolute_uri, check_tracking, tracking_uri
from scripts.mlflow_server import free_port


def test_a_keys_steps_only_go_up_and_the_oldest_values_go_past_the_limit():
    buffer = PointBuffer(limit=3)
    assert buffer.add(1, {"train/loss": 0.5, "eval/accuracy": None}, at=1.0) == 0
    assert buffer.add(1, {"train/loss": 0.4}, at=2.0) == 0  # a step computed again: kept once
    assert buffer.add(2, {"train/loss": 0.3, "perf/samples_per_s": 9.0}, at=3.0) == 0
    assert [(v.key, v.step, v.value, v.at_ms) for v in buffer.peek(10)] == [
        ("loss", 1, 0.5, 1000), ("loss", 2, 0.3, 3000), ("perf/samples_per_s", 2, 9.0, 3000)]
    assert buffer.add(3, {"train/loss": 0.2}, at=4.0) == 1 and buffer.dropped == 1
    sent = buffer.peek(2)
    buffer.taken(sent)
    assert [(v.key, v.step) for v in buffer.peek(10)] == [("loss", 3)]
    buffer.forget_up_to({"loss": 5})  # a resumed tracking run has steps up to 5
    assert len(buffer) == 0
    buffer.add(5, {"train/loss": 0.1}, at=5.0)
    buffer.add(6, {"train/loss": 0.1}, at=6.0)
    assert [v.step for v in buffer.peek(10)] == [6]


def test_a_config_becomes_dotted_params_within_mlflows_limits():
    params = flat_params({"trainer": {"optimizer": {"lr": 0.1}, "layers": [64, 32]},
                          "data": {"train": {}}, "odd:key": "x" * 7000})
    assert params["trainer.optimizer.lr"] == "0.1" and params["trainer.layers"] == "[64, 32]"
    assert params["data.train"] == "{}" and len(params["odd_key"]) == 6000


def test_a_local_store_is_taken_from_the_commands_folder(tmp_path):
    assert absolute_uri("file:./mlruns", tmp_path) == f"file://{tmp_path}/mlruns"
    assert absolute_uri("sqlite:///m.db", tmp_path) == f"sqlite:///{tmp_path}/m.db"
    assert absolute_uri("sqlite:////abs/m.db", tmp_path) == "sqlite:////abs/m.db"
    assert absolute_uri("mlruns", tmp_path) == str(tmp_path / "mlruns")
    assert absolute_uri("http://host:5000", tmp_path) == "http://host:5000"
    assert absolute_uri("databricks", tmp_path) == "databricks"


def test_a_server_that_does_not_answer_is_refused_naming_the_key(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match=r"^tracking\.uri: required with tracking=mlflow"):
        tracking_uri(None)
    with pytest.raises(ConfigError, match=r"^tracking\.uri=ftp://x: not a tracking store"):
        tracking_uri("ftp://x")
    nobody = f"http://user:hunter22@127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError) as refused:
        check_tracking("mlflow", nobody, required=True)
    line = str(refused.value)
    assert line.startswith("tracking.uri=http://***@127.0.0.1:") and "hunter22" not in line
    assert "does not answer" in line and "tracking.required=false" in line
    assert "does not answer" in check_tracking("mlflow", nobody, required=False)
    assert check_tracking("none", None, required=True) is None


class Store:
    """The run's checkpoint store, as far as the tracker uses it."""

    def __init__(self):
        self.records = {}

    def read_run_record(self, name):
        return self.records.get(name)

    def write_run_record(self, name, record):
        self.records[name] = record


def test_the_tracker_keeps_values_while_the_server_is_away_and_never_blocks(
        mlflow_server, tmp_path, caplog, monkeypatch):
    from mlflow.tracking import MlflowClient

    from orchestrator.tracking.mlflow_run import MlflowTracker, TrackedRun

    def tracked(**more):
        return TrackedRun(uri=mlflow_server.uri, experiment="tracker-alone", run_name="alone",
                          params={"trainer.lr": "0.1"}, tags={"orchestrator.trainer": "ddp"},
                          store=store, **more)

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")  # a server away is seen sooner
    store, record = Store(), tmp_path / "run.json"
    record.write_text("{}\n")
    caplog.set_level(logging.INFO, logger="orchestrator")
    tracker = MlflowTracker(tracked())
    tracker.begin()
    assert tracker.opened(60) is None and not tracker.resumed
    tracker.add([(s, 1000.0 + s, {"train/loss": 1 / s}, {}) for s in range(1, 11)])
    mlflow_server.pause()
    try:
        started = time.monotonic()
        for s in range(11, 31):  # the driver hands values on as the run goes: never waits
            tracker.add([(s, 1000.0 + s, {"train/loss": 1 / s}, {"checkpoint.latest": f"c{s}"})])
        assert time.monotonic() - started < 1.0
        deadline = time.monotonic() + 120
        while "did not take a request" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        mlflow_server.resume()
    assert tracker.finish("succeeded", [str(record)])
    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["checkpoint.latest"] == "c30"
    history = client.get_metric_history(tracker.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 31))  # none lost, none twice
    assert [a.path for a in client.list_artifacts(tracker.run_id)] == ["run.json"]
    said = caplog.text
    assert "did not take a request" in said and "answers again" in said

    # The same run again (a resume: its id kept in the store) continues it, its steps once;
    # a server away at the end costs the run tracking.flush_s, then a warning.
    again = MlflowTracker(tracked(flush_s=2.0))
    again.begin()
    assert again.opened(60) is None and again.resumed and again.run_id == tracker.run_id
    again.add([(s, 2000.0 + s, {"train/loss": 2.0}, {}) for s in range(25, 41)])
    mlflow_server.pause()
    try:
        started = time.monotonic()
        assert not again.finish("failed")
        assert time.monotonic() - started < 4.0
    finally:
        mlflow_server.resume()
    assert "were not sent" in caplog.text and "tracking.flush_s=2" in caplog.text
    steps = [m.step for m in client.get_metric_history(tracker.run_id, "loss")]
    assert len(steps) == len(set(steps)) and max(steps) <= 40

