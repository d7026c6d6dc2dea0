"""trainer=script on real Ray: a torchrun script of the ddp-tutorial-series shape
(tests/user_project/scripts/ddp_snapshot.py), unchanged. Given as a torchrun command line, it
ends with the weights plain torchrun gives; given as a python command, SIGKILLed while it
overwrites its snapshot in place, it resumes from the newest committed snapshot (never the
torn one) and ends with the same weights."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.storage.location import StorageSpec
from tests.conftest import finish_run, start_run, user_project, wait_for

pytestmark = pytest.mark.slow
EPOCHS = 8
SCRIPT = "scripts/ddp_snapshot.py"


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def committed_snapshots(storage: Path, run: str) -> dict[int, dict]:
    """Every committed checkpoint's snapshot.pt, loaded: {checkpoint step: snapshot}."""
    store = CheckpointStore(StorageSpec(str(storage / run)))
    snapshots = {}
    for ref in store.committed():
        files, _ = store.load(ref)
        snapshots[ref.step] = torch.load(__import__("io").BytesIO(files["node_0/work/snapshot.pt"]))
    return snapshots


def newest_epoch(storage: Path, run: str) -> int:
    """EPOCHS_RUN of the newest committed snapshot (0: none yet)."""
    snapshots = committed_snapshots(storage, run)
    return snapshots[max(snapshots)]["EPOCHS_RUN"] if snapshots else 0


def log(run_dir: Path, rank: int) -> str:
    path = run_dir / "logs" / f"rank_{rank}.log"
    return path.read_text() if path.exists() else ""


def test_a_torchrun_script_runs_unchanged_and_a_rank_killed_mid_write_resumes_from_a_whole_snapshot(
        ray_head, tmp_path):
    project, storage = user_project(tmp_path), tmp_path / "ckpt"
    common = [f"cluster.address={ray_head.address}", f"storage.uri={storage}",
              "checkpoint.keep=0", "cluster.cpus_per_worker=0.5", "trainer=script",
              "trainer.checkpoint_files=[snapshot.pt]"]
    straight = start_run(tmp_path / "straight", *common, "run.name=straight",
                         f"trainer.command=OMP_NUM_THREADS=2 torchrun --nproc-per-node=2 {SCRIPT} "
                         f"{EPOCHS} 1", cwd=project)
    gate, go = tmp_path / "gate", tmp_path / "go"
    gate.touch()
    killed = start_run(tmp_path / "killed", *common, "run.name=killed", "cluster.workers=2",
                       f"trainer.command=python {SCRIPT} {EPOCHS} 1 --pace-while {gate} "
                       f"--slow-save-at 3 --slow-save-when {go}", cwd=project)
    # Epoch 3's save waits for `go`: epoch 2's snapshot, closed and still until then, is
    # taken however slowly this machine polls (before, a loaded machine could miss epochs
    # 0-2's and wait for a checkpoint forever).
    wait_for(lambda r: newest_epoch(storage, "killed") == 3, tmp_path / "killed")
    go.touch()
    # Rank 0 is half-way through overwriting snapshot.pt with epoch 3's: SIGKILL its script.
    rec = wait_for(lambda r: "writing the snapshot of epoch 3" in log(tmp_path / "killed", 0),
                   tmp_path / "killed")
    (script,) = children_of(rec["workers"][0]["pid"])
    os.kill(script, signal.SIGKILL)
    wait_for(lambda r: r.get("restarts") == 1, tmp_path / "killed")
    resumes_at = newest_epoch(storage, "killed")  # what the restart found: its next save
    gate.unlink()  # waits on the gate
    runs = {"straight": finish_run(straight, tmp_path / "straight"),
            "killed": finish_run(killed, tmp_path / "killed")}
    for name, run in runs.items():
        assert run.returncode == 0, (name, run.output[-4000:])
    by_hand = tmp_path / "by-hand"
    by_hand.mkdir()
    subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node=2",
                    str(project / SCRIPT), str(EPOCHS), "1"], cwd=by_hand, check=True,
                   capture_output=True, timeout=300)
    expected = torch.load(by_hand / "snapshot.pt")["MODEL_STATE"]

    # The torchrun command line (with the shell's assignment before it): torchrun's
    # environment, each rank's lines in the run folder and rank 0's on the console, the
    # weights of plain torchrun, and the file it wrote where it runs, in the user's folder.
    out, rec = runs["straight"].output, runs["straight"].record
    assert "env RANK=1 LOCAL_RANK=1 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 GROUP_WORLD_SIZE=1" in \
        log(tmp_path / "straight", 1)
    assert "OMP_NUM_THREADS=2" in log(tmp_path / "straight", 1)
    assert (project / "results.txt").read_text() == f"trained {EPOCHS} epochs\n"
    assert not (project / "snapshot.pt").exists()  # the run's own: in its checkpoints
    assert f"[rank0] [GPU0] Epoch {EPOCHS - 1}" in out and "[GPU1]" not in out
    assert f"[GPU1] Epoch {EPOCHS - 1}" in log(tmp_path / "straight", 1)
    final = committed_snapshots(storage, "straight")
    assert final[max(final)]["EPOCHS_RUN"] == EPOCHS and rec["status"] == "succeeded"
    assert all(torch.equal(final[max(final)]["MODEL_STATE"][k], expected[k]) for k in expected)

    # Killed mid-write: the failure named in one line, every committed snapshot whole (the
    # torn one never committed), the restart from the newest, the same final weights.
    rec = runs["killed"].record
    assert rec["restarts"] == 1 and any("rank 0's script killed by SIGKILL" in f["message"]
                                        for f in rec["failures"]), rec["failures"]
    snapshots = committed_snapshots(storage, "killed")  # torch.load of each: none torn
    assert resumes_at == 3  # epoch 2's, the last one before the kill
    assert f"Resuming training from snapshot at Epoch {resumes_at}" in log(tmp_path / "killed", 0)
    assert "TORCHELASTIC_RESTART_COUNT=1" in log(tmp_path / "killed", 1)
    last = snapshots[max(snapshots)]
    assert last["EPOCHS_RUN"] == EPOCHS
    assert all(torch.equal(last["MODEL_STATE"][k], expected[k]) for k in expected)
