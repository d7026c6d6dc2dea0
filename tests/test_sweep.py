"""Sweeps end to end: `--multirun` trials as orchestrated runs on Ray Tune, on one real Ray
head shared by this module; the sweep record, the scaling report, early stopping, a failing
trial, resuming a sweep, and an invalid sweep."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, _started, cli_env, forked, read_record
from tests.helpers import sweep, sweep_record

pytestmark = pytest.mark.slow


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_a_parallelism_sweep_runs_each_trial_and_writes_the_scaling_report(ray_head, tmp_path):
    out = tmp_path / "sweep"
    # A grid needs no metric: one no trial reports does not fail them (none is "best").
    proc = sweep(out, "cluster.workers=1,2", "trainer.epochs=2", "hydra.sweeper.metric=test_mse",
                 address=ray_head.address)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rec = sweep_record(out)
    rows = rec["trials"]
    assert rec["best"] is None and rec["status"] == "done"
    for row in rows:
        row["metric"] = row["metrics"]["test_accuracy"]
    assert sorted(r["overrides"][0] for r in rows) == ["cluster.workers=1", "cluster.workers=2"]
    assert all(r["status"] == "succeeded" for r in rows)
    by_workers = {r["workers"]: r for r in rows}
    assert set(by_workers) == {1, 2}
    for workers, row in by_workers.items():
        run = json.loads((Path(row["run_dir"]) / "run.json").read_text())
        assert run["status"] == "succeeded" and run["world_sizes"][0]["size"] == workers
        assert row["samples_per_s"] == run["samples_per_s"] > 0
        assert row["metric"] == run["metrics"]["test_accuracy"]
    # Each trial kept its own checkpoints (no trial resumed another's).
    assert len({json.loads((Path(r["run_dir"]) / "run.json").read_text())["checkpoint_uri"]
                for r in rows}) == 2
    base = by_workers[1]
    assert base["speedup"] == 1.0 and base["efficiency"] == 1.0
    assert by_workers[2]["speedup"] == pytest.approx(
        by_workers[2]["samples_per_s"] / base["samples_per_s"], rel=1e-2)
    assert by_workers[2]["efficiency"] == pytest.approx(by_workers[2]["speedup"] / 2, rel=1e-2)
    # The global batch is the same at any world size: the trials end with the same model.
    assert max(r["metric"] for r in rows) - min(r["metric"] for r in rows) <= 0.01
    table = [line for line in (out / "scaling.md").read_text().splitlines()
             if line.startswith("| ") and not line.startswith("| trial")]
    assert len(table) == 2 and all("succeeded" in line for line in table)
    width, height = png_size(out / "scaling.png")
    assert width > 100 and height > 100
    assert "scaling.md" not in proc.stderr and "| trial |" in proc.stdout


def test_a_search_stops_a_poor_trial_records_a_failing_one_and_a_rerun_skips_finished_ones(
        ray_head, tmp_path):
    """hpo=ddp_lr_workers (test loss every 20 steps, ASHA from step 20 here) over a grid of
    learning rates: 0.2 trains, 0.0001 is far too small (and paced after step 20) and ASHA
    stops it at a rung, and the trial at 0.0002 fails at step 15 (a bug in its training code,
    for that lr only). The same command again resumes the sweep: the finished trials are not
    run again, the failed one is."""
    out = tmp_path / "hpo"
    args = ("hpo=ddp_lr_workers", "hydra.sweeper.search=grid", "hydra.sweeper.num_samples=1",
            "trainer.lr=0.2,0.0002,0.0001", "cluster.workers=1", "trainer.batch_size=64",
            "trainer.epochs=5", "hydra.sweeper.max_concurrent=2",
            "hydra.sweeper.early_stopping.grace_period=20", "failure.max_restarts=0",
            "trainer.fn=tests.user_trainers:fails_for_one_lr", "+trainer.fail_lr=0.0002",
            "+trainer.slow_lr=0.0001")
    first = sweep(out, *args, address=ray_head.address)
    assert first.returncode == 1, (first.stdout + first.stderr)[-4000:]
    rec = sweep_record(out)
    assert rec["metric"] == "test_loss" and rec["mode"] == "min"
    rows = {r["overrides"][0]: r for r in rec["trials"]}
    good, bad, poor = rows["trainer.lr=0.2"], rows["trainer.lr=0.0002"], rows["trainer.lr=0.0001"]
    assert good["status"] == "succeeded" and rec["best"]["overrides"][0] == "trainer.lr=0.2"
    assert poor["status"] == "stopped early" and poor["steps"] < good["steps"], poor
    assert bad["status"] == "failed" and "bad batch at step 15" in bad["error"], bad
    assert "trainer.lr=0.0002" in first.stderr and "failed" in first.stderr
    done = {key: Path(rows[key]["run_dir"]) / "run.json" for key in rows}
    before = {key: path.read_text() for key, path in done.items()}
    failed_started = json.loads(before["trainer.lr=0.0002"])["started_at"]

    again = sweep(out, *args, address=ray_head.address)
    assert again.returncode == 1, (again.stdout + again.stderr)[-4000:]
    assert "resuming" in again.stdout + again.stderr
    for key in ("trainer.lr=0.2", "trainer.lr=0.0001"):  # finished: not run again
        assert done[key].read_text() == before[key], key
    assert json.loads(done["trainer.lr=0.0002"].read_text())["started_at"] > failed_started
    rows = {r["overrides"][0]: r for r in sweep_record(out)["trials"]}
    assert rows["trainer.lr=0.2"]["status"] == "succeeded"
    assert rows["trainer.lr=0.0002"]["status"] == "failed"


def test_ctrl_c_stops_a_sweep_and_the_same_command_resumes_each_trial_from_its_checkpoints(
        ray_head, tmp_path, mlflow_server):
    """Run from a user's folder with relative paths (storage.uri=ckpt): the trials' checkpoints
    are under that folder, not Tune's; Ctrl-C exits 130 with the trials recorded as
    interrupted, and the one waiting for room as not started, in sweep.json and scaling.md;
    the same command resumes each from its own newest checkpoint and runs the third. Tracked
    in MLflow (a real server): one parent run, one nested run per trial, across the resume."""
    project, gate = tmp_path / "project", tmp_path / "gate"
    project.mkdir()
    gate.write_text("hold")
    cmd = [sys.executable, "-m", "orchestrator", "--multirun", "hydra.sweep.dir=sweep",
           f"cluster.address={ray_head.address}", "storage.uri=ckpt", "cluster.workers=1",
           "trainer.lr=0.1,0.05,0.02", "hydra.sweeper.max_concurrent=2",
           "checkpoint.every_steps=50",
           "trainer.fn=tests.user_trainers:gated_ddp", f"+trainer.gate={gate}",
           "+trainer.hold_at=120", "tracking=mlflow", f"tracking.uri={mlflow_server.uri}",
           "tracking.experiment=ctrl-c-sweep"]
    env = cli_env({"PYTHONPATH": str(REPO)})  # the gated function is the repository's
    proc = subprocess.Popen(forked(cmd), cwd=project, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    _started.append(proc)
    deadline = time.time() + 600
    while time.time() < deadline:  # both trials held at step 120, step 100 committed
        records = [read_record(p.parent) for p in (project / "sweep").glob("*/run.json")]
        if len(records) == 2 and all(100 in [c["step"] for c in r.get("checkpoints", [])]
                                     for r in records):
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-4000:]
    assert "Tuner.restore(" not in out and "the same command runs the rest" in out, out[-4000:]
    rec = sweep_record(project / "sweep")
    assert rec["status"] == "interrupted" and sorted(r["status"] for r in rec["trials"]) == \
        ["interrupted", "interrupted", "not started"], rec
    assert "3 trials" in (project / "sweep" / "scaling.md").read_text()
    assert "| not started |" in (project / "sweep" / "scaling.md").read_text()
    runs = [read_record(Path(r["run_dir"])) for r in rec["trials"] if r["status"] != "not started"]
    for run in runs:
        assert run["checkpoint_uri"].startswith(str(project / "ckpt")), run["checkpoint_uri"]

    gate.unlink()
    again = subprocess.run(forked(cmd), cwd=project, env=env, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    rec = sweep_record(project / "sweep")
    assert rec["status"] == "done" and all(r["status"] == "succeeded" for r in rec["trials"])
    resumed = [read_record(Path(row["run_dir"])) for row in rec["trials"]]
    assert sorted(bool(run["resumed_from_step"]) for run in resumed) == [False, True, True]
    for run in resumed:
        assert (run["resumed_from_step"] or 100) >= 100 and run["checkpoint_uri"].startswith(
            str(project / "ckpt")), run
    assert_a_parent_run_with_a_nested_run_per_trial(mlflow_server, rec)


def assert_a_parent_run_with_a_nested_run_per_trial(server, rec: dict) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("ctrl-c-sweep")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert [p.info.run_name for p in parents] == [rec["name"]]  # one, though resumed
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {
        "sweep.json", "scaling.md", "scaling.png"}
    trials = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(trials) == len(runs) - 1 == 3  # a resumed trial continued its own run
    assert sorted(t.data.params["trainer.lr"] for t in trials) == ["0.02", "0.05", "0.1"]
    assert all(t.info.status == "FINISHED" and t.data.metrics.get("loss") is not None
               for t in trials)
    assert {t.info.run_name for t in trials} == {
        read_record(Path(r["run_dir"]))["run_name"] for r in rec["trials"]}


def test_an_invalid_value_in_a_sweep_stops_it_before_any_trial(tmp_path):
    out = tmp_path / "invalid"
    proc = sweep(out, "cluster.workers=2,0", address="127.0.0.1:1", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: cluster.workers=0 is not allowed: an integer >= 1"
    assert not out.exists() and not (tmp_path / "ckpt").exists()
