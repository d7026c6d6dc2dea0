"""trainer=script's decisions without Ray: reading torchrun command lines, the checks made
before Ray starts, and which written files are taken as a checkpoint."""

from __future__ import annotations

import json
import os

import pytest

from orchestrator.cli import quote_commands
from orchestrator.errors import ConfigError
from trainers.script.command import cluster_from_command, parse_command
from trainers.script.config import check_script
from trainers.script.files import CheckpointWatcher, make_node_folder, restore_files
from trainers.script.process import ScriptProcess


@pytest.mark.parametrize("command, argv, script, workers", [
    ("python train.py 50 10 --batch_size 32", ["python", "train.py", "50", "10", "--batch_size",
                                               "32"], "train.py", None),
    ("python -u train.py", ["python", "-u", "train.py"], "train.py", None),
    ("torchrun --nproc-per-node=2 train.py 5", ["python", "train.py", "5"], "train.py", (2, 2)),
    ("torchrun --nproc_per_node 4 --standalone t.py", ["python", "t.py"], "t.py", (4, 4)),
    ("torchrun --nnodes=1:3 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=h:29400 t.py",
     ["python", "t.py"], "t.py", (2, 6)),
    ("python -m torch.distributed.run --nnodes 2 t.py", ["python", "t.py"], "t.py", (2, 2)),
    # No size flags: the size is cluster.workers'
    ("torchrun -m mypkg.train --lr 0.1", ["python", "-m", "mypkg.train", "--lr", "0.1"], None,
     None),
])
def test_command_lines_are_read_as_python_and_torchrun_read_them(command, argv, script, workers):
    parsed = parse_command(command)
    assert (parsed.argv, parsed.script, parsed.workers) == (argv, script, workers)


@pytest.mark.parametrize("command, says", [
    ("", "trainer.command: a value is required"),
    ("torchrun --nproc-per-node=2", "names no script after torchrun's flags"),
    ("torchrun --nprocs=2 t.py", "--nprocs is not a torchrun flag"),
    ("torchrun --nproc-per-node=auto t.py", "--nproc-per-node=auto is not allowed here"),
    ("torchrun --nnodes=3:1 t.py", "--nnodes=3:1 is not allowed: MIN:MAX with MIN <= MAX"),
    ("python 'unclosed", "cannot be read as a command line"),
])
def test_bad_command_lines_are_one_line_naming_the_key(command, says):
    with pytest.raises(ConfigError, match="trainer.command") as err:
        parse_command(command)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_torchrun_flags_size_the_run_unless_the_command_line_says_otherwise(tmp_path):
    trainer = {"command": "torchrun --nnodes=1:2 --nproc-per-node=2 t.py", "workdir": str(tmp_path)}
    (tmp_path / "t.py").write_text("import torch.distributed as d\nd.init_process_group('gloo')\n")
    assert cluster_from_command(trainer, {"workers": 2}, set()) == {"workers": 4, "min_workers": 2}
    assert cluster_from_command(trainer, {"workers": 4}, {"workers"})["workers"] == 4
    with pytest.raises(ConfigError, match=r"cluster.workers=3 contradicts .*--nnodes=1:2 "
                                          r"--nproc-per-node=2: workers=4"):
        cluster_from_command(trainer, {"workers": 3}, {"workers"})
    assert cluster_from_command({**trainer, "command": "python t.py"}, {}, set()) == {}
    (tmp_path / "t.py").write_text("dist.init_process_group(backend='nccl')\n")
    with pytest.raises(ConfigError, match="asks for the nccl backend, which needs GPUs"):
        cluster_from_command(trainer, {"gpus_per_worker": 0}, set())
    assert cluster_from_command(trainer, {"gpus_per_worker": 1}, set())["workers"] == 4


def test_the_script_must_exist_and_checkpoint_files_stay_inside_the_workdir(tmp_path):
    (tmp_path / "train.py").write_text("")
    ok = {"workdir": str(tmp_path), "command": "python train.py", "checkpoint_files": ["ckpt/*.pt"]}
    check_script({"trainer": ok})
    with pytest.raises(ConfigError, match="the script 'nope.py' does not exist in trainer.workdir="):
        check_script({"trainer": {**ok, "command": "python nope.py"}})
    for bad in ("../x.pt", "/etc/x", "~/x.pt", "a/../../x"):
        with pytest.raises(ConfigError, match="trainer.checkpoint_files: .* is not allowed"):
            check_script({"trainer": {**ok, "checkpoint_files": [bad]}})


def test_a_command_line_value_reaches_hydra_quoted():
    assert quote_commands(["trainer.command=torchrun --nproc-per-node=2 t.py", "x=1"]) == \
        ["trainer.command='torchrun --nproc-per-node=2 t.py'", "x=1"]
    assert quote_commands(["trainer.command='python t.py'"]) == ["trainer.command='python t.py'"]
    assert quote_commands(["trainer.command=python -c 'print(1)'"]) == \
        ["trainer.command='python -c \\'print(1)\\''"]


def test_a_file_is_taken_only_once_closed_and_still_and_put_back_from_the_commit(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "train.py").write_text("code")
    (user / "snapshot.pt").write_text("an old run's snapshot: not this run's")
    work, ckpt = make_node_folder(tmp_path / "node", user, ["snapshot.pt", "ckpt/*.pt"])
    assert (work / "train.py").is_symlink() and not (work / "snapshot.pt").exists()
    assert (work / "ckpt").is_dir() and not (work / "ckpt").is_symlink()
    watcher = CheckpointWatcher(work, ckpt, ["snapshot.pt", "ckpt/*.pt"], tmp_path / "pending")
    assert not watcher.poll()
    with open(work / "snapshot.pt", "wb") as f:  # open: half written, never taken
        f.write(b"half")
        f.flush()
        assert not watcher.poll() and not watcher.poll() and not watcher.has_new()
        f.write(b" and the rest")
    (ckpt / "extra.bin").write_bytes(b"x")
    assert not watcher.poll()  # closed, but not yet still across two looks
    assert watcher.poll()
    (work / "snapshot.pt").write_bytes(b"overwritten in place after the copy")
    folder = tmp_path / "checkpoint"
    watcher.write_into(folder, node_rank=0)
    assert (folder / "node_0/work/snapshot.pt").read_bytes() == b"half and the rest"
    assert (folder / "node_0/checkpoint_dir/extra.bin").read_bytes() == b"x"
    # A restart on another node puts node 0's files back (the snapshot rank 0 wrote).
    work2, ckpt2 = make_node_folder(tmp_path / "node1", user, ["snapshot.pt"])
    assert restore_files(folder, 1, work2, ckpt2) == 2
    assert (work2 / "snapshot.pt").read_bytes() == b"half and the rest"
    assert not CheckpointWatcher(work2, ckpt2, ["snapshot.pt"], tmp_path / "p2").poll()


def test_a_failed_rank_is_one_line_from_torchs_error_file_else_its_stderr(tmp_path):
    proc = ScriptProcess(["python", "-c", "import sys; print('boom', file=sys.stderr); "
                          "sys.exit(3)"], dict(os.environ), tmp_path, 1, tmp_path / "err.json")
    code = proc.wait()
    assert code == 3 and proc.failure(code) == "rank 1's script exited with code 3: boom"
    (tmp_path / "err.json").write_text(json.dumps(
        {"message": {"message": "ValueError: bad shape\nTraceback...\nValueError: bad shape",
                     "extraInfo": {}}}))
    assert proc.failure(-9) == "rank 1's script killed by SIGKILL: ValueError: bad shape"
