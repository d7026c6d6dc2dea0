"""Your own training function on real Ray: a user's package in a folder of its own (a plain
torch DDP loop on the public worker API), every rank writing its own checkpoint file; a rank
killed mid-checkpoint, then a corrupt rank file in the newest checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.storage.location import StorageSpec
from tests.conftest import KEEP_SPARES, finish_run, run_cli, start_run, user_project
from tests.helpers import stored_path


def files_of_latest(storage, run_name) -> tuple[dict, dict[str, bytes]]:
    store = CheckpointStore(StorageSpec(str(storage / run_name)))
    files, _ = store.load(store.latest())
    return store.read_manifest(store.latest()), files


def test_a_users_loop_survives_a_rank_killed_mid_checkpoint_and_ends_bit_identical(ray_head, tmp_path):
    """Then a rank's file of the newest checkpoint corrupted (same size): the next run resumes
    from the one before, with the reason in run.json warnings."""
    project, storage = user_project(tmp_path), tmp_path / "ckpt"
    common = ["trainer=function", f"cluster.address={ray_head.address}", f"storage.uri={storage}",
              "checkpoint.every_steps=100", "checkpoint.keep=0", "cluster.cpus_per_worker=0.5"]
    # The uninterrupted run goes alongside (each takes half the head's CPUs).
    straight = start_run(tmp_path / "straight", *common, "+trainer.steps=300",
                         "trainer.fn=mypkg.train:main", "run.name=straight", cwd=project)
    crashing = ["trainer.fn=mypkg.faults:crash_while_saving", "+trainer.crash_at=200",
                f"+trainer.marker={tmp_path / 'crashed-once'}", "+trainer.committed_first="
                f"{storage / 'crashed' / 'step_000000100' / 'manifest.json'}", "run.name=crashed",
                KEEP_SPARES]  # its restart into them
    crashed = run_cli(tmp_path / "crashed", *common, "+trainer.steps=300", *crashing, cwd=project)
    assert crashed.returncode == 0, crashed.output[-4000:]
    rec = crashed.record
    assert (tmp_path / "crashed-once").read_text() == "200"  # rank 1 died writing step 200
    # Step 200 never became the latest: the restart resumed from step 100.
    assert rec["restarts"] == 1 and [(w["size"], w["step"]) for w in rec["world_sizes"]] == \
        [(2, 0), (2, 100)], rec["world_sizes"]
    assert rec["lost_steps"] == 100 and rec["steps"] == 300
    assert [c["step"] for c in rec["checkpoints"]] == [100, 200, 300]  # 200: the second attempt's
    manifest, files = files_of_latest(storage, "crashed")
    assert manifest["world_size"] == 2
    assert {n: e["rank"] for n, e in manifest["files"].items()} == {
        "model.pt": 0, "optimizer.pt": 0, "rank_0.json": 0, "rank_1.json": 1}
    assert json.loads(files["rank_1.json"]) == {"rows_seen": 300 * 32}  # its own count, exact
    assert rec["metrics"]["accuracy"] > 0.9

    straight = finish_run(straight, tmp_path / "straight")
    assert straight.returncode == 0, straight.output[-4000:]
    _, reference = files_of_latest(storage, "straight")
    a, b = (torch.load(__import__("io").BytesIO(f["model.pt"]), weights_only=True)
            for f in (files, reference))
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run's weights differ"
    assert files["optimizer.pt"] == reference["optimizer.pt"]
    assert straight.record["metrics"] == rec["metrics"]

    rank_file = Path(stored_path(storage / "crashed" / "step_000000300", "rank_1.json"))
    good = rank_file.read_bytes()
    rank_file.write_bytes(good.replace(b"9600", b"9601"))  # the same size, other bytes
    # The finished run asked for 100 steps more (the same function: it crashes only once).
    again = run_cli(tmp_path / "again", *common, "+trainer.steps=400", *crashing, cwd=project)
    assert again.returncode == 0, again.output[-4000:]
    assert again.record["resumed_from_step"] == 200 and again.record["steps"] == 400
    assert any("step_000000300/rank_1.json does not match its manifest" in w
               for w in again.record["warnings"]), again.record["warnings"]
