"""Streamed parquet on real Ray (data.stream=true, trainer=ddp): the bundled digits written as
parquet files of several row groups, with a row-id column the model logs. The same rows at
every step at 1, 2 and 4 workers; a rank SIGKILLed mid-epoch resumes and ends bit for bit
equal to the run that never stopped; each rank reads about half the bytes; a resume over data
that changed since is refused."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.conftest import REPO, finish_run, run_cli, start_run, user_project, wait_for
from tests.helpers import digits_parquet, model_at, rows_per_step

pytestmark = pytest.mark.slow
BATCH, STEPS, SHARDS = 32, 120, 4


def job(data, log_dir, storage, workers, cpus) -> list[str]:
    log_dir.mkdir()
    return ["trainer=ddp", "data=parquet", f"data.path={data}", "data.stream=true",
            f"data.shards={SHARDS}", "trainer.model._target_=mypkg.ids.LoggingTabular",
            "~trainer.model.hidden", f"+trainer.model.log_dir={log_dir}",
            f"trainer.batch_size={BATCH}", "trainer.epochs=100", f"trainer.max_steps={STEPS}",
            "checkpoint.every_steps=30", "checkpoint.keep=0", f"storage.uri={storage}",
            f"cluster.workers={workers}", f"cluster.cpus_per_worker={cpus}"]


def test_streamed_rows_are_the_same_at_any_size_and_a_killed_rank_resumes_bit_for_bit(
        ray_head, tmp_path):
    project, storage = user_project(tmp_path), tmp_path / "ckpt"
    data = digits_parquet(tmp_path / "data")
    head = [f"cluster.address={ray_head.address}"]
    # Four runs side by side on the head's 2 CPUs: 2 workers uninterrupted, 2 killed, 4 and 1.
    runs = {name: start_run(tmp_path / name, *head, f"run.name={name}",
                            *job(data, tmp_path / f"ids-{name}", storage, workers, cpus),
                            cwd=project)
            for name, workers, cpus in (("straight", 2, 0.5), ("four", 4, 0.2), ("one", 1, 0.2))}
    # A rank SIGKILLed mid-epoch, after the checkpoint at step 30 (an epoch is ~44 steps),
    # while the run is held at step 50 by the gate: the restart resumes from step 30.
    gate = tmp_path / "gate"
    gate.write_text("hold")
    runs["killed"] = start_run(tmp_path / "killed", *head, "run.name=killed",
                               *job(data, tmp_path / "ids-killed", storage, 2, 0.5),
                               "trainer.fn=tests.user_trainers:gated_ddp", f"+trainer.gate={gate}",
                               "+trainer.hold_at=50", cwd=project, env={"PYTHONPATH": str(REPO)})
    rec = wait_for(lambda r: 30 in [c["step"] for c in r.get("checkpoints", [])]
                   and len(r.get("workers", [])) == 2, tmp_path / "killed")
    os.kill(rec["workers"][1]["pid"], signal.SIGKILL)
    wait_for(lambda r: r.get("restarts") == 1, tmp_path / "killed")
    gate.unlink()
    done = {name: finish_run(proc, tmp_path / name) for name, proc in runs.items()}
    for name, run in done.items():
        assert run.returncode == 0, (name, run.output[-4000:])
    straight, killed, four, one = (done[n] for n in ("straight", "killed", "four", "one"))

    reference = rows_per_step(tmp_path / "ids-straight", straight.record)
    assert sorted(reference) == list(range(STEPS))
    assert all(len(r) == BATCH and len(set(r)) == BATCH for r in reference.values())
    data_facts = straight.record["data"]
    epoch = data_facts["steps_per_epoch"]
    assert 30 < epoch < STEPS / 2, data_facts  # the kill and the resume were mid-epoch
    first_epoch = [x for s in range(epoch) for x in reference[s]]
    assert len(set(first_epoch)) == len(first_epoch)  # no row twice in an epoch
    for run, name in ((four, "four"), (one, "one")):
        assert rows_per_step(tmp_path / f"ids-{name}", run.record) == reference, name
    rec = killed.record
    assert [(w["size"], w["step"]) for w in rec["world_sizes"]] == [(2, 0), (2, 30)]
    assert rows_per_step(tmp_path / "ids-killed", rec) == reference
    # The killed rank's staging folder went at the restart, the emptied folder at the end.
    assert not [n for n in ("killed", "straight") if (storage / n / ".staging").exists()]
    a, b = model_at(storage, "killed"), model_at(storage, "straight")
    assert all(torch.equal(a[k], b[k]) for k in a), "the killed-and-resumed run differs"
    assert rec["metrics"] == straight.record["metrics"]
    assert straight.record["metrics"]["test_accuracy"] > 0.9

    # Each of 2 ranks read about half the bytes an epoch takes, 2.7 epochs and the evaluation.
    assert data_facts["shards"] == SHARDS and data_facts["files"] == 6
    assert data_facts["row_groups"] == 18 and data_facts["rows"] == 1797
    epochs = STEPS / epoch
    for rank, read in data_facts["ranks"].items():
        assert read["to_step"] == STEPS
        assert read["bytes_read"] < 1.25 / 2 * data_facts["bytes"] * (epochs + 2), (rank, read)

    # The data changes (a file more): the same run again is refused, nothing touched.
    extra = data / "digits-6.parquet"
    extra.write_bytes((data / "digits-0.parquet").read_bytes())
    before = sorted(p.name for p in (storage / "straight").iterdir())
    again = run_cli(tmp_path / "again", *head, "run.name=straight",
                    *job(data, tmp_path / "ids-again", storage, 2, 0.5), cwd=project)
    assert again.returncode == 2, again.output[-3000:]
    assert f"error: data.path='{data}' changed since the checkpoint this run resumes from " \
           f"(1 file added ({extra}))" in again.stderr
    assert sorted(p.name for p in (storage / "straight").iterdir()) == before
