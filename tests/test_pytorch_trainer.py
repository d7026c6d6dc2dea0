"""The general PyTorch trainer on real Ray, with a user's own dataset and model (a copy of
tests/user_project outside the repository): DataLoader processes, gradient accumulation,
exact resume after a SIGKILL and after Ctrl-C (the same command again), and a resume at
another world size seeing the same samples. The dataset augments its items with noise drawn
in the DataLoader processes (from torch, numpy and random): the resumed run draws the same."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch

from tests.conftest import (
    KEEP_SPARES,
    REPO,
    finish_run,
    read_record,
    run_cli,
    start_run,
    user_project,
    wait_for,
)
from tests.helpers import model_at

pytestmark = pytest.mark.slow
BATCH, MICRO, STEPS = 64, 8, 300


def job(log_dir, storage) -> list[str]:
    return ["data=torch", "data.train._target_=mypkg.ids.NumberedDigits",
            "+data.train.split=train", "+data.train.noise=0.05",
            "data.eval._target_=mypkg.ids.NumberedDigits",
            "+data.eval.split=test", "data.num_workers=2",
            "trainer.model._target_=mypkg.ids.LoggingMLP", f"+trainer.model.log_dir={log_dir}",
            f"trainer.batch_size={BATCH}", f"trainer.micro_batch_size={MICRO}",
            "trainer.epochs=100", f"trainer.max_steps={STEPS}", "checkpoint.every_steps=100",
            "checkpoint.keep=0", f"storage.uri={storage}"]


def ids_per_step(log_dir, record: dict) -> dict[int, list[int]]:
    """The sample ids each step trained on, over all ranks, from the model's log: each rank's
    lines come in attempts (one pid each, starting at the step the record says), a step being
    the micro-batches every rank runs at that world size; a later attempt's step wins."""
    starts = [(w["step"], w["size"]) for w in record["world_sizes"]]
    seen: dict[int, dict[int, list[int]]] = {}
    for path in sorted(log_dir.glob("rank*.jsonl")):
        attempts: list[list[list[int]]] = []
        last_pid = None
        for pid, ids in map(json.loads, path.read_text().splitlines()):
            if pid != last_pid:
                attempts.append([])
                last_pid = pid
            attempts[-1].append(ids)
        rank = int(path.stem[4:])
        for (start, size), lines in zip(starts, attempts, strict=False):
            per_step = math.ceil(math.ceil(BATCH / size) / MICRO)  # micro-batches a step
            for i in range(0, len(lines) - per_step + 1, per_step):
                ids = sorted(x for line in lines[i:i + per_step] for x in line)
                seen.setdefault(start + i // per_step, {})[rank] = ids
    return {step: sorted(x for ids in ranks.values() for x in ids) for step, ranks in seen.items()}


def test_killed_and_interrupted_run_ends_bit_identical_and_a_resize_sees_the_same_samples(
        ray_head, tmp_path, mlflow_server):
    """Also MLflow (tracking=mlflow, a real server): the killed, interrupted and resumed run
    is one MLflow run whose curves are the uninterrupted run's, each step once, though the
    server went away (SIGSTOP) while the run restarted and trained on."""
    project, storage = user_project(tmp_path), tmp_path / "ckpt"
    cluster = [f"cluster.address={ray_head.address}", "cluster.cpus_per_worker=0.5",
               "tracking=mlflow", f"tracking.uri={mlflow_server.uri}",
               "tracking.experiment=killed-and-straight"]
    logs = {name: tmp_path / f"ids-{name}" for name in ("killed", "resized")}
    logs["straight"] = project / "ids-straight"  # given relative to the command's folder
    for folder in logs.values():
        folder.mkdir()

    # The uninterrupted run goes alongside the killed one (each takes half the head's CPUs).
    # Its model's log_dir is relative (a user's own keyword): its workers start in the
    # command's folder, as torchrun's do, or its log would not be found there.
    straight = start_run(tmp_path / "straight", *cluster, *job("ids-straight", storage),
                         "run.name=straight", cwd=project)

    # 1. A worker SIGKILLed after the first checkpoint: the same world size resumes from it.
    #    Then, held at step 250 (a gate) once step 200 is committed, the user stops the
    #    command (Ctrl-C), and runs the same command again: it resumes at step 200.
    gate = tmp_path / "gate"
    gate.write_text("hold")
    killed = [*cluster, *job(logs["killed"], storage), "run.name=killed",
              "trainer.fn=tests.user_trainers:gated_ddp", f"+trainer.gate={gate}",
              "+trainer.hold_at=250", KEEP_SPARES]  # its restart into them
    # The gate is a test function of this repository's (tests/user_trainers.py), next to the
    # user's own package: the repository on the import path too.
    repo = {"PYTHONPATH": str(REPO)}
    proc = start_run(tmp_path / "killed", *killed, cwd=project, env=repo)
    rec = wait_for(lambda r: r.get("checkpoints") and len(r.get("workers", [])) == 2,
                   tmp_path / "killed")
    os.kill(rec["workers"][1]["pid"], signal.SIGKILL)
    mlflow_server.pause()  # away while the group restarts and trains on
    paused_at = read_record(tmp_path / "killed")["steps"]
    # Step 200 committed after the restart: the run is at most at the gate (250), short of 300.
    first = wait_for(lambda r: r.get("restarts") == 1 and
                     200 in [c["step"] for c in r["checkpoints"]], tmp_path / "killed")
    mlflow_server.resume()
    assert first["steps"] >= 200 > paused_at  # training never waited for the server
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert "the newest committed checkpoint (step 200) is kept for a resume" in out
    assert read_record(tmp_path / "killed")["status"] == "interrupted"
    tracked = mlflow_runs(mlflow_server, "killed-and-straight")
    assert tracked["killed"].info.status == "KILLED", out[-3000:]
    gate.unlink()
    # 2's run (below) goes alongside the same command again.
    resized = start_run(tmp_path / "resized", *cluster, *job(logs["resized"], storage),
                        "cluster.workers=1", "run.name=resized",
                        f"resume={storage / 'killed' / 'step_000000100'}", cwd=project)
    again = run_cli(tmp_path / "killed-again", *killed, cwd=project, env=repo)
    assert again.returncode == 0, again.output[-4000:]
    straight = finish_run(straight, tmp_path / "straight")
    assert straight.returncode == 0, straight.output[-4000:]
    straight_rec = straight.record
    reference = ids_per_step(logs["straight"], straight_rec)
    assert sorted(reference) == list(range(STEPS))
    assert all(len(ids) == BATCH and len(set(ids)) == BATCH for ids in reference.values())
    rec = again.record
    assert rec["resumed_from_step"] == 200 and "resuming at step 200" in again.output
    assert [w["size"] for w in first["world_sizes"]] == [2, 2] and first["world_sizes"][1]["step"] == 100
    both = {"world_sizes": first["world_sizes"] + rec["world_sizes"]}
    assert ids_per_step(logs["killed"], both) == reference
    a, b = model_at(storage, "killed"), model_at(storage, "straight")
    assert all(torch.equal(a[k], b[k]) for k in a), "the killed-and-resumed run differs"
    assert rec["metrics"] == straight_rec["metrics"]
    assert_one_mlflow_run_like_the_straight_one(mlflow_server, storage)

    # 2. The killed run's checkpoint at step 100, resumed by one worker: 8 micro-batches a step
    # instead of 4, the same rows at every step, the same parameters up to float rounding.
    resized = finish_run(resized, tmp_path / "resized")
    assert resized.returncode == 0, resized.output[-4000:]
    rec = resized.record
    assert [(w["size"], w["step"]) for w in rec["world_sizes"]] == [(1, 100)]
    seen = ids_per_step(logs["resized"], rec)
    assert sorted(seen) == list(range(100, STEPS))
    assert seen == {step: reference[step] for step in range(100, STEPS)}
    a, b = model_at(storage, "resized"), model_at(storage, "straight")
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-4, f"parameters differ by {worst}"


def mlflow_runs(server, experiment: str) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(server.uri)
    found = client.get_experiment_by_name(experiment)
    return {r.info.run_name: r for r in client.search_runs([found.experiment_id])}


def assert_one_mlflow_run_like_the_straight_one(server, storage) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(server.uri)
    runs = mlflow_runs(server, "killed-and-straight")
    assert sorted(runs) == ["killed", "resized", "straight"]  # one across the kill, Ctrl-C, rerun
    killed, straight = runs["killed"], runs["straight"]
    assert killed.info.status == straight.info.status == "FINISHED"
    kept = json.loads((storage / "killed" / "mlflow.json").read_text())
    assert kept["run_id"] == killed.info.run_id

    def curve(run, key):
        return [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key),
                                                  key=lambda m: m.step)]

    loss = curve(killed, "loss")
    assert [step for step, _ in loss] == list(range(1, STEPS + 1))  # each step once
    assert loss == curve(straight, "loss")  # bit for bit, the values logged while away included
    assert {v for _, v in curve(killed, "cluster/world_size")} == {2}
    assert max(v for _, v in curve(killed, "cluster/restarts")) == 1
    assert curve(killed, "eval/test_accuracy") == curve(straight, "eval/test_accuracy") != []
    params, tags = killed.data.params, killed.data.tags
    assert params["trainer.max_steps"] == str(STEPS) and params["run.name"] == "killed"
    assert params["tracking.uri"] == server.uri and "trainer.gate" in params
    assert tags["orchestrator.trainer"] == "ddp" and tags["orchestrator.run_name"] == "killed"
    assert tags["checkpoint.latest"] == tags[f"checkpoint.step_{STEPS:09d}"]
    assert tags["checkpoint.latest"].endswith(f"step_{STEPS:09d}")
    assert f"checkpoint.step_{100:09d}" in tags  # every committed checkpoint's URI
    assert "run.json" in [a.path for a in client.list_artifacts(killed.info.run_id)]


def test_freed_host_memory_goes_back_for_a_sharded_job_on_cpu_unless_told_otherwise():
    """trainer.release_host_memory: null means on for FSDP on CPU only (its peak crept up
    step after step with glibc's default; scripts/bench.py fsdp_memory measures both)."""
    from trainers.pytorch.host_memory import wanted

    assert wanted(None, "fsdp", "cpu")
    assert not wanted(None, "ddp", "cpu") and not wanted(None, "fsdp", "cuda")
    assert wanted(True, "ddp", "cpu") and not wanted(False, "fsdp", "cpu")
