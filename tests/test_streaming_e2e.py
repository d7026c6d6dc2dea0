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

from tests.conftest import (
    KEEP_SPARES,
    REPO,
    finish_run,
    run_cli,
    start_run,
    user_project,
    wait_for,
)
from tests.helpers import digits_parquet, model_at, rows_per_step

pytestmark = pytest.mark.slow
BATCH, STEPS, SHARDS = 32, 120, 4


def job(data, log_dir, storage, workers, cpus) -> list[str]:
    log_dir.mkdir(exist_ok=True)
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
                               "+trainer.hold_at=50", KEEP_SPARES,  # its restart into them
                               cwd=project, env={"PYTHONPATH": str(REPO)})
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
    assert f"error: data.path='{data}' changed since run straight's checkpoint at step " \
           f"{STEPS} (1 file added ({extra}))" in again.stderr
    assert sorted(p.name for p in (storage / "straight").iterdir()) == before
    # The data as it was: the finished run's command trains nothing, says so, starts no worker.
    extra.unlink()
    done = run_cli(tmp_path / "done", *head, "run.name=straight",
                   *job(data, tmp_path / "ids-straight", storage, 2, 0.5), cwd=project)
    assert done.returncode == 0, done.output[-3000:]
    assert f"run straight finished at step {STEPS} on " in done.output
    assert "asking Ray for" not in done.output and done.record["status"] == "already_finished"


def test_held_parquet_whose_labels_changed_is_refused_restart_trains_again_and_done_is_done(
        ray_head, tmp_path):
    """Parquet held in memory (data.stream=false): every label rewritten after the run, the
    same number of rows and bytes, is refused naming the file (a checkpoint keeps the data's
    content digests); data.on_change=restart trains again from step 0 over the data as it is;
    then the same command says the run finished and starts no worker; a named run's finished
    command with another learning rate is refused naming the key."""
    import pyarrow.parquet as pq

    project, storage = user_project(tmp_path), tmp_path / "ckpt"
    data = digits_parquet(tmp_path / "data")
    common = [f"cluster.address={ray_head.address}", "data=parquet", f"data.path={data}",
              "data.stream=false", "checkpoint.every_steps=10", f"storage.uri={storage}",
              "cluster.cpus_per_worker=0.5"]
    named = [*common, "run.name=named"]
    common.append("trainer.max_steps=20")
    first = run_cli(tmp_path / "first", *common, cwd=project)
    assert first.returncode == 0, first.output[-3000:]
    name = first.record["run_name"]

    # The same rows as CSV files (a folder of them): converted once beside the runs, the same
    # training to the bit.
    import pyarrow.csv as pacsv

    csv = tmp_path / "csv"
    csv.mkdir()
    for part in sorted(data.iterdir()):
        pacsv.write_csv(pq.read_table(part), csv / part.name.replace(".parquet", ".csv"))
    as_csv = run_cli(tmp_path / "csv-run", *[a for a in common if not a.startswith("data.path")],
                     f"data.path={csv}", cwd=project)
    assert as_csv.returncode == 0, as_csv.output[-3000:]
    assert as_csv.record["metrics"] == first.record["metrics"]
    assert as_csv.record["config"]["data"]["source"] == str(csv)
    assert [p.name for p in (storage / "_data").iterdir()] == [
        as_csv.record["config"]["data"]["path"].rsplit("/", 1)[1]]

    table = pq.read_table(data / "digits-3.parquet")
    flipped = table.set_column(table.schema.get_field_index("label"), "label",
                               pa_labels(9 - table["label"].to_numpy()))
    pq.write_table(flipped, data / "digits-3.parquet", row_group_size=100)
    listing = sorted(p.name for p in (storage / name).iterdir())
    refused = run_cli(tmp_path / "refused", *common, cwd=project)
    assert refused.returncode == 2, refused.output[-3000:]
    assert f"error: data.path='{data}' changed since run {name}'s checkpoint at step 20 " \
           f"(1 file rewritten ({data / 'digits-3.parquet'})): training on would mix two " \
           "versions of the data" in refused.stderr
    assert "data.on_change=restart" in refused.stderr and "asking Ray for" not in refused.output
    assert sorted(p.name for p in (storage / name).iterdir()) == listing  # nothing touched

    again = run_cli(tmp_path / "restart", *common, "data.on_change=restart", cwd=project)
    assert again.returncode == 0, again.output[-3000:]
    assert again.record["resumed_from_step"] is None and again.record["steps"] == 20
    assert again.record["world_sizes"][0]["step"] == 0
    assert again.record["metrics"] != first.record["metrics"]  # trained on the flipped labels

    done = run_cli(tmp_path / "done", *common, cwd=project)
    assert done.returncode == 0, done.output[-3000:]
    assert f"run {name} finished at step 20 on " in done.output
    assert "; nothing to train" in done.output and "asking Ray for" not in done.output
    assert done.record["status"] == "already_finished"
    assert done.record["metrics"] == again.record["metrics"]

    assert run_cli(tmp_path / "named", *named, "trainer.max_steps=10", cwd=project).returncode == 0
    other = run_cli(tmp_path / "other", *named, "trainer.max_steps=10", "trainer.lr=0.05",
                    cwd=project)
    assert other.returncode == 2, other.output[-3000:]
    assert "error: run.name='named' finished at step 10 on " in other.stderr
    assert "with other settings: trainer.lr (0.1 then, 0.05 now)" in other.stderr
    longer = run_cli(tmp_path / "longer", *named, "trainer.max_steps=15", cwd=project)
    assert longer.returncode == 0, longer.output[-3000:]
    assert longer.record["resumed_from_step"] == 10 and longer.record["steps"] == 15


def pa_labels(values):
    import pyarrow as pa

    return pa.array(values)
