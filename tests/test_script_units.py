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
from trainers.script.files import (
    CheckpointWatcher,
    keep_new_entries,
    make_node_folder,
    restore_files,
)
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
    # No size flags: the size is cluster.workers' (or torchrun's default, below)
    ("torchrun -m mypkg.train --lr 0.1", ["python", "-m", "mypkg.train", "--lr", "0.1"], None,
     None),
    ("python3.11 -u -m torch.distributed.run --nproc_per_node=2 t.py", ["python", "t.py"], "t.py",
     (2, 2)),
    ("torchrun -r3 --tee=3 --max-restarts 2 --nproc-per-node=2 t.py", ["python", "t.py"], "t.py",
     (2, 2)),
])
def test_command_lines_are_read_as_python_and_torchrun_read_them(command, argv, script, workers):
    parsed = parse_command(command)
    assert (parsed.argv, parsed.script, parsed.workers) == (argv, script, workers)


@pytest.mark.parametrize("command, says", [
    ("", "trainer.command: a value is required"),
    ("torchrun --nproc-per-node=2", "names no script after torchrun's flags"),
    ("torchrun --nprocs=2 t.py", "--nprocs is not a torchrun flag"),
    ("torchrun --nnodes=3:1 t.py", "--nnodes=3:1 is not allowed: MIN:MAX with MIN <= MAX"),
    ("python 'unclosed", "cannot be read as a command line"),
    ("python t.py 2>&1 | tee log.txt",
     "'>' in '2>&1' is a shell's, and the command is not run by a shell"),
    ("python t.py > log.txt", "'>' is a shell's"),
    # operators a shell reads inside a word, not only as a word of their own
    ("python train.py 50 10|tee log", "'|' in '10|tee' is a shell's"),
    ("python train.py --epochs 3; python eval.py", "';' in '3;' is a shell's"),
    ('python t.py --tag "$(date)"', "'$(' in '\"$(date)\"' is a shell's"),
    ("CUDA_VISIBLE_DEVICES=0,1 torchrun t.py", "CUDA_VISIBLE_DEVICES is set for each worker"),
    # what each rank's script is given is not the command's to set
    ("LOCAL_WORLD_SIZE=8 python t.py", "LOCAL_WORLD_SIZE is set for each worker"),
    ("CHECKPOINT_DIR=./ckpt python t.py", "CHECKPOINT_DIR is set for each worker"),
    ("TORCHELASTIC_RESTART_COUNT=0 python t.py", "TORCHELASTIC_RESTART_COUNT is set for each"),
    # a torchrun started by another program would be every worker's own launcher
    ("uv run torchrun --nproc-per-node=2 t.py", "torchrun inside another program (uv)"),
    ("env OMP_NUM_THREADS=4 torchrun t.py", "torchrun inside another program (env)"),
    ("torchrun --use-env t.py", "--use-env is not a torchrun flag"),
])
def test_bad_command_lines_are_one_line_naming_the_key(command, says):
    with pytest.raises(ConfigError, match="trainer.command") as err:
        parse_command(command)
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("command, argv", [
    ("python t.py --sep '|' --filter '>0.5' --op '<'",
     ["python", "t.py", "--sep", "|", "--filter", ">0.5", "--op", "<"]),
    ('python t.py --x "a;b" \\| c', ["python", "t.py", "--x", "a;b", "|", "c"]),
    ("torchrun --nproc-per-node=2 -- t.py --lr 1", ["python", "t.py", "--lr", "1"]),
    ("python -c 'import t; t.main()' --lr 1", ["python", "-c", "import t; t.main()", "--lr", "1"]),
])
def test_quoted_operators_the_end_of_flags_and_code_on_the_line_are_read_as_a_shell_would(
        command, argv):
    assert parse_command(command).argv == argv


def test_a_shells_assignments_and_the_legacy_launchers_local_rank_reach_the_script():
    parsed = parse_command("OMP_NUM_THREADS=4 NCCL_DEBUG=INFO torchrun --nproc-per-node=2 t.py 5")
    assert parsed.env == {"OMP_NUM_THREADS": "4", "NCCL_DEBUG": "INFO"}
    assert (parsed.argv, parsed.workers) == (["python", "t.py", "5"], (2, 2))
    # torch.distributed.launch gives the script --local-rank=N before its arguments (as
    # torch 2.13's does), unless --use-env; torchrun never does.
    launch = "python -m torch.distributed.launch --nproc-per-node=2 {}t.py --lr 1"
    assert parse_command(launch.format("")).argv_for(1) == \
        ["python", "t.py", "--local-rank=1", "--lr", "1"]
    assert parse_command(launch.format("--use-env ")).argv_for(1) == ["python", "t.py", "--lr", "1"]
    assert parse_command("torchrun --nproc-per-node=2 t.py --lr 1").argv_for(1) == \
        ["python", "t.py", "--lr", "1"]
    assert parse_command("python -m torch.distributed.launch -m pkg.train").argv_for(0) == \
        ["python", "-m", "pkg.train", "--local-rank=0"]


def test_torchrun_flags_size_the_run_unless_the_command_line_says_otherwise(tmp_path):
    trainer = {"command": "torchrun --nnodes=1:2 --nproc-per-node=2 t.py", "workdir": str(tmp_path)}
    (tmp_path / "t.py").write_text("import torch.distributed as d\nd.init_process_group('gloo')\n")
    assert cluster_from_command(trainer, {"workers": 2}, set()) == {"workers": 4, "min_workers": 2}
    assert cluster_from_command(trainer, {"workers": 4}, {"workers"})["workers"] == 4
    with pytest.raises(ConfigError, match=r"cluster.workers=3 contradicts .*--nnodes=1:2 "
                                          r"--nproc-per-node=2: workers=4"):
        cluster_from_command(trainer, {"workers": 3}, {"workers"})
    assert cluster_from_command({**trainer, "command": "python t.py"}, {}, set()) == {}
    # torchrun without size flags starts one process; a cluster.workers given sizes it
    plain = {**trainer, "command": "torchrun --standalone t.py"}
    assert cluster_from_command(plain, {"workers": 2}, set()) == {"workers": 1}
    assert cluster_from_command(plain, {"workers": 3}, {"workers"}) == {}
    # --nproc-per-node=auto counts a node's devices, which Ray places: cluster.workers sizes it
    auto = {**trainer, "command": "torchrun --nproc-per-node=auto t.py"}
    with pytest.raises(ConfigError, match="--nproc-per-node=auto counts a node's devices.*"
                                          "give cluster.workers=N"):
        cluster_from_command(auto, {"workers": 2}, set())
    assert cluster_from_command(auto, {"workers": 4}, {"workers"}) == {}
    (tmp_path / "t.py").write_text("dist.init_process_group(backend='nccl')\n")
    with pytest.raises(ConfigError, match="asks for the nccl backend, which needs GPUs"):
        cluster_from_command(trainer, {"gpus_per_worker": 0}, set())
    assert cluster_from_command(trainer, {"gpus_per_worker": 1}, set())["workers"] == 4
    # The usual idiom falls back to gloo on CPU, and a comment is not code: both start.
    for script in ('backend = "nccl" if torch.cuda.is_available() else "gloo"\n',
                   "# dist.init_process_group('nccl')\ndist.init_process_group()\n"):
        (tmp_path / "t.py").write_text(script)
        assert cluster_from_command(trainer, {"gpus_per_worker": 0}, set())["workers"] == 4


def test_the_script_must_exist_and_checkpoint_files_stay_inside_the_workdir(tmp_path):
    (tmp_path / "train.py").write_text("")
    ok = {"workdir": str(tmp_path), "command": "python train.py", "checkpoint_files": ["ckpt/*.pt"]}
    check_script({"trainer": ok})
    with pytest.raises(ConfigError, match="the script 'nope.py' does not exist in trainer.workdir="):
        check_script({"trainer": {**ok, "command": "python nope.py"}})
    # a program of its own must be one the workers can run
    (tmp_path / "run.sh").write_text("#!/bin/sh\npython train.py\n")
    with pytest.raises(ConfigError, match="'./run.sh' in .* is not executable"):
        check_script({"trainer": {**ok, "command": "./run.sh"}})
    (tmp_path / "run.sh").chmod(0o755)
    check_script({"trainer": {**ok, "command": "./run.sh"}})
    with pytest.raises(ConfigError, match="the program 'pyhton' is not on PATH"):
        check_script({"trainer": {**ok, "command": "pyhton train.py"}})
    for bad in ("../x.pt", "/etc/x", "~/x.pt", "a/../../x", "**/*.pt", "*/snapshot.pt", "."):
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
    assert restore_files(folder, 1, work2, ckpt2, ["snapshot.pt"]) == \
        {"work/snapshot.pt", "checkpoint_dir/extra.bin"}  # node 0's: not node 1's own
    assert (work2 / "snapshot.pt").read_bytes() == b"half and the rest"
    assert not CheckpointWatcher(work2, ckpt2, ["snapshot.pt"], tmp_path / "p2").poll()


def test_a_snapshot_node_1_got_from_node_0_stays_node_0s_in_later_checkpoints(tmp_path):
    """Rank 0 alone writes snapshot.pt (pytorch/examples' multinode.py). Node 1 starts from
    node 0's copy, and keeps no copy of its own: the next restart gives it node 0's newer one."""
    user = tmp_path / "user"
    user.mkdir()
    checkpoint = tmp_path / "c1"
    (checkpoint / "node_0/work").mkdir(parents=True)
    (checkpoint / "node_0/work/snapshot.pt").write_text("epoch 10")
    nodes = {}
    for node in (0, 1):
        work, ckpt = make_node_folder(tmp_path / f"n{node}", user, ["snapshot.pt"])
        borrowed = restore_files(checkpoint, node, work, ckpt, ["snapshot.pt"])
        nodes[node] = (work, CheckpointWatcher(work, ckpt, ["snapshot.pt"],
                                               tmp_path / f"p{node}", borrowed=borrowed))
    assert (nodes[1][0] / "snapshot.pt").read_text() == "epoch 10"
    (nodes[0][0] / "snapshot.pt").write_text("epoch 20")  # rank 0 saves
    assert not nodes[0][1].poll() and nodes[0][1].poll()
    later = tmp_path / "c2"
    for node, (_, watcher) in nodes.items():
        watcher.write_into(later, node)
    assert (later / "node_0/work/snapshot.pt").read_text() == "epoch 20"
    assert not (later / "node_1").exists()  # node 1 restores node 0's "epoch 20" next time
    # A file node 1 writes itself is its own from then on.
    (nodes[1][0] / "snapshot.pt").write_text("node 1's own")
    assert not nodes[1][1].poll() and nodes[1][1].poll()
    nodes[1][1].write_into(tmp_path / "c3", 1)
    assert (tmp_path / "c3/node_1/work/snapshot.pt").read_text() == "node 1's own"
    # A node with files of its own gets node 0's others too: a snapshot only rank 0 writes
    # beside node 1's own rng state.
    (later / "node_1/checkpoint_dir").mkdir(parents=True)
    (later / "node_1/checkpoint_dir/rng1.pt").write_text("node 1's rng")
    work, ckpt = make_node_folder(tmp_path / "n1b", user, ["snapshot.pt"])
    assert restore_files(later, 1, work, ckpt, ["snapshot.pt"]) == {"work/snapshot.pt"}
    assert (work / "snapshot.pt").read_text() == "epoch 20"
    assert (ckpt / "rng1.pt").read_text() == "node 1's rng"


def test_a_checkpoint_from_elsewhere_puts_back_only_its_checkpoint_files_never_into_yours(
        tmp_path):
    """resume=<uri> of someone's checkpoint listing scripts/train.py: it was copied through the
    script folder's link over the user's own code, and a sitecustomize.py it listed was moved
    into trainer.workdir at the end."""
    user = tmp_path / "user"
    (user / "scripts").mkdir(parents=True)
    (user / "scripts" / "train.py").write_text("your code")
    checkpoint = tmp_path / "c"
    for name, text in (("snapshot.pt", "weights"), ("ckpt/a.pt", "a"),
                       ("scripts/train.py", "import os; os.system('x')"),
                       ("sitecustomize.py", "planted")):
        (checkpoint / "node_0/work" / name).parent.mkdir(parents=True, exist_ok=True)
        (checkpoint / "node_0/work" / name).write_text(text)
    patterns = ["snapshot.pt", "ckpt"]
    work, ckpt = make_node_folder(tmp_path / "n", user, patterns)
    restore_files(checkpoint, 0, work, ckpt, patterns)
    assert (work / "snapshot.pt").read_text() == "weights" and (work / "ckpt/a.pt").exists()
    # a pattern with ** names files at any depth, as the watcher took them
    deep = make_node_folder(tmp_path / "deep", user, ["ckpt/**/*.pt"])[0]
    (checkpoint / "node_0/work/ckpt/x/y").mkdir(parents=True)
    (checkpoint / "node_0/work/ckpt/x/y/z.pt").write_text("z")
    restore_files(checkpoint, 0, deep, tmp_path / "deep_ckpt", ["ckpt/**/*.pt"])
    assert (deep / "ckpt/x/y/z.pt").read_text() == "z" and (deep / "ckpt/a.pt").exists()
    assert (user / "scripts" / "train.py").read_text() == "your code"
    assert keep_new_entries(work, user, patterns) == [] and not (user / "sitecustomize.py").exists()


def test_words_above_the_workdir_are_read_from_it_and_variables_as_a_shell_gives_them(tmp_path):
    from trainers.script.files import outside_paths_absolute
    from trainers.script.run import expand

    workdir = tmp_path / "proj" / "exp"
    argv = ["python", "../common/train.py", "--data", "../data/x.csv", "--out=../o", "data/y",
            "-x..", ".."]
    assert outside_paths_absolute(argv, workdir) == [
        "python", str(tmp_path / "proj/common/train.py"), "--data", str(tmp_path / "proj/data/x.csv"),
        f"--out={tmp_path / 'proj/o'}", "data/y", "-x..", str(tmp_path / "proj")]
    env = {"CHECKPOINT_DIR": "/c", "HOME": "/h"}
    assert [expand(w, env) for w in ("{checkpoint_dir}/a", "$CHECKPOINT_DIR/b", "${HOME}x",
                                     "$NOT_SET", "50%")] == ["/c/a", "/c/b", "/hx", "$NOT_SET", "50%"]


def test_a_folder_named_is_its_files_and_a_kill_takes_only_what_was_seen_closed(tmp_path):
    user = tmp_path / "user"
    (user / "ckpt").mkdir(parents=True)  # the script saves into it: ckpt/model.pt
    work, ckpt = make_node_folder(tmp_path / "node", user, ["ckpt", "snapshot.pt"])
    assert (work / "ckpt").is_dir() and not (work / "ckpt").is_symlink()
    watcher = CheckpointWatcher(work, ckpt, ["ckpt", "snapshot.pt"], tmp_path / "pending")
    (work / "ckpt" / "step_1").mkdir(parents=True)  # a DCP or Hugging Face folder
    (work / "ckpt" / "step_1" / "model.bin").write_bytes(b"weights")
    assert not watcher.poll() and watcher.poll()
    with open(work / "snapshot.pt", "wb") as f:  # open at the last poll, then the kill
        f.write(b"torn")
        f.flush()
        assert not watcher.poll()
    assert not watcher.poll(settled=False) and "work/snapshot.pt" not in watcher.taken
    folder = tmp_path / "checkpoint"
    watcher.write_into(folder, node_rank=0)
    assert (folder / "node_0/work/ckpt/step_1/model.bin").read_bytes() == b"weights"
    assert not (folder / "node_0/work/snapshot.pt").exists()


def test_what_the_script_made_in_its_folder_is_the_users_when_it_ends(tmp_path):
    user = tmp_path / "user"
    (user / "logs").mkdir(parents=True)
    (user / "results.json").write_text("last run's")
    work, _ = make_node_folder(tmp_path / "node", user, ["snapshot.pt"])
    (work / "model_final.pt").write_bytes(b"final")  # new
    (work / "runs" / "exp1").mkdir(parents=True)  # a new folder (TensorBoard)
    (work / "runs" / "exp1" / "events").write_bytes(b"e")
    (work / "logs" / "train.log").write_text("through the link")  # already the user's
    (work / "results.json").unlink()  # an atomic write replaces the link
    (work / "results.json").write_text("this run's")
    (work / "snapshot.pt").write_bytes(b"the run's checkpoint")  # private: in its checkpoints
    assert keep_new_entries(work, user, ["snapshot.pt"]) == ["model_final.pt", "results.json",
                                                             "runs"]
    assert (user / "model_final.pt").read_bytes() == b"final"
    assert (user / "runs" / "exp1" / "events").read_bytes() == b"e"
    assert (user / "results.json").read_text() == "this run's"
    assert (user / "logs" / "train.log").read_text() == "through the link"
    assert not (user / "snapshot.pt").exists()


def test_a_failed_rank_is_one_line_from_torchs_error_file_else_its_stderr(tmp_path):
    proc = ScriptProcess(["python", "-c", "import sys; print('boom', file=sys.stderr); "
                          "sys.exit(3)"], dict(os.environ), tmp_path, 1, tmp_path / "err.json")
    code = proc.wait()
    assert code == 3 and proc.failure(code) == "rank 1's script exited with code 3: boom"
    (tmp_path / "err.json").write_text(json.dumps(
        {"message": {"message": "ValueError: bad shape\nTraceback...\nValueError: bad shape",
                     "extraInfo": {}}}))
    assert proc.failure(-9) == "rank 1's script killed by SIGKILL: ValueError: bad shape"
    # killed after a library's warning: that is not why (it read 'super().__init__(loader)')
    warned = ScriptProcess(["python", "-c", "import sys; print('Traceback (most recent call "
                            "last):\\nRuntimeError: gloo lost its peer', file=sys.stderr); "
                            "print('  super().__init__(loader)', file=sys.stderr); "
                            "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                           dict(os.environ), tmp_path, 2, tmp_path / "none.json")
    code = warned.wait()
    assert warned.failure(code) == "rank 2's script killed by SIGKILL: RuntimeError: gloo lost its peer"
    quiet = ScriptProcess(["python", "-c", "import sys; print('a warning', file=sys.stderr); "
                           "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                          dict(os.environ), tmp_path, 3, tmp_path / "none.json")
    code = quiet.wait()
    assert quiet.failure(code) == "rank 3's script killed by SIGKILL"


def test_a_sweeps_trial_shares_its_cpus_among_the_workers_torchruns_flags_ask_for(tmp_path):
    """A trial's CPU budget is cut per worker once the trainer has sized the run: with
    --nproc-per-node=4, a quarter each, not half (the default cluster.workers=2)."""
    from types import SimpleNamespace

    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.singleton import Singleton
    from hydra.types import RunMode

    from orchestrator.cli import CONF_DIR
    from orchestrator.sweep.space import build_space
    from orchestrator.sweep.trial import TrialContext, compose_trial

    (tmp_path / "t.py").write_text("print('hi')\n")
    fixed = ["trainer=script", f"trainer.workdir={tmp_path}",
             "trainer.command='torchrun --nproc-per-node=4 t.py'"]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        master = loader.load_configuration("config", fixed + ["seed=0,1"], RunMode.MULTIRUN)
        space = build_space([*fixed, "seed=0,1"], {})
        ctx = TrialContext(SimpleNamespace(config_loader=loader), master, Singleton.get_state(),
                           space,
                           str(tmp_path / "sweep"), "s", "loss", cpu_budget=1.0, run_name="s",
                           command_dir=str(tmp_path))
        cfg = compose_trial(ctx, {"seed": "1"}, "t1")
    assert (cfg.cluster.workers, cfg.cluster.cpus_per_worker, cfg.seed) == (4, 0.25, 1)


def test_every_variable_the_script_is_given_is_refused_in_the_command_but_the_tunable_ones(
        monkeypatch, tmp_path):
    """The command's refused names (command.py) and what each rank is given (run.py's
    script_env) are two lists: a variable added to one must be in the other."""
    from types import SimpleNamespace

    from trainers.script.run import script_env

    monkeypatch.setattr(os, "environ", {})
    ctx = SimpleNamespace(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                          max_restarts=3, run_name="r")
    given = set(script_env(ctx, {"nodes": 1, "addr": "h", "port": 1, "restarts": 0}, {},
                           tmp_path, tmp_path, tmp_path))
    tunable = {"OMP_NUM_THREADS", "PYTHONUNBUFFERED"}  # OMP_NUM_THREADS=4 torchrun ... is yours
    for name in sorted(given - tunable):
        with pytest.raises(ConfigError, match=f"{name} is set for each worker"):
            parse_command(f"{name}=1 python t.py")
    for name in tunable:
        assert parse_command(f"{name}=4 python t.py").env == {name: "4"}


def refused_line(folder_maker) -> str:
    from trainers.script.folders import ScriptFolderNotPrivate

    with pytest.raises(ScriptFolderNotPrivate) as refused:
        folder_maker()
    assert refused.value.retry is False and "\n" not in str(refused.value)
    return str(refused.value)


@pytest.mark.skipif(os.getuid() != 0, reason="plants a folder owned by another user: root")
def test_a_folder_another_user_planted_where_the_script_runs_is_never_used(tmp_path, monkeypatch):
    """Issue: /tmp/orchestrator-script was whoever's made it first; a 0777 one planted before
    the first run could swap the run's folder (its train.py) and read the checkpoints put
    back. The node's folder is a new one in this user's private base; a base planted by
    another user stops the run with one line, and nothing is written into it."""
    import tempfile

    from orchestrator.private_dir import BASE_VARIABLE
    from trainers.script.folders import NodeFolder, folder_prefix, script_base

    def plant(path):
        path.mkdir()
        path.chmod(0o777)
        os.chown(path, 65534, 65534)
        return path

    monkeypatch.delenv(BASE_VARIABLE, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old = plant(tmp_path / "orchestrator-script")  # the old, shared location
    folder = NodeFolder(script_base(), folder_prefix("run", "ab12cd34", 0))
    assert folder.path.parent == tmp_path / f"orchestrator-{os.getuid()}" / "script"
    assert list(old.iterdir()) == []
    for private in (folder.path, folder.path.parent, folder.path.parent.parent):
        info = os.lstat(private)
        assert (info.st_uid, info.st_mode & 0o777) == (os.getuid(), 0o700)
    folder.remove()
    # The new location planted before this user's first run: refused, never used.
    monkeypatch.setenv(BASE_VARIABLE, str(tmp_path / "mine"))
    (tmp_path / "mine").mkdir(mode=0o700)
    planted = plant(tmp_path / "mine" / "script")
    assert "is not this user's alone (owned by uid 65534)" in refused_line(script_base)
    monkeypatch.setenv(BASE_VARIABLE, str(tmp_path / "theirs"))
    plant(tmp_path / "theirs")
    assert "owned by uid 65534" in refused_line(script_base)
    # A link planted where the base goes is refused too, not followed.
    monkeypatch.setenv(BASE_VARIABLE, str(tmp_path / "linked"))
    (tmp_path / "linked").mkdir(mode=0o700)
    (tmp_path / "linked" / "script").symlink_to(planted)
    assert "it is a symbolic link" in refused_line(script_base)
    assert list(planted.iterdir()) == []


HOLD_A_NODE_FOLDER = """
import sys, time
from pathlib import Path
from trainers.script.folders import NodeFolder
folder = NodeFolder(Path(sys.argv[1]), sys.argv[2])
(folder.path / "work").mkdir()
print(folder.path, flush=True)
time.sleep(600)
"""


def test_two_live_runs_of_one_name_keep_their_folders_and_a_killed_ones_goes(tmp_path):
    """Issue: a run removed every <run>-* folder but its own on start, a live run's of the
    same name too. Now a folder goes only once its worker is gone (its lock is free), and
    only where this host made it; the node's other ranks find the one their local rank 0 made."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from orchestrator.worker.workdir import OWNER, remove_abandoned
    from trainers.script.folders import NodeFolder, folder_prefix, node_folder_made

    base = tmp_path / "script"
    base.mkdir(mode=0o700)

    def hold(attempt):
        proc = subprocess.Popen([sys.executable, "-c", HOLD_A_NODE_FOLDER, str(base),
                                 folder_prefix("train", attempt, 0)], stdout=subprocess.PIPE,
                                text=True, cwd=Path(__file__).parent.parent)
        return proc, Path(proc.stdout.readline().strip())

    (killed, dead), (alive, live) = hold("aaaa1111"), hold("bbbb2222")
    elsewhere = base / "train-cccc3333-node0-x"  # a shared TMPDIR: another machine's
    elsewhere.mkdir()
    (elsewhere / OWNER).write_text("another-host")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=60)
        assert (dead / "work").is_dir()  # a killed worker cleans nothing
        mine = NodeFolder(base, folder_prefix("train", "dddd4444", 0))  # the same run name
        assert not dead.exists() and (live / "work").is_dir() and elsewhere.exists()
        same_process = NodeFolder(base, folder_prefix("train", "eeee5555", 0))
        assert mine.path.is_dir() and same_process.path.is_dir()
        assert remove_abandoned(base, "") == []  # every live one stays
        assert node_folder_made(base, folder_prefix("train", "dddd4444", 0)) == mine.path
        assert NodeFolder(base, mine.path.name[:-8]).path != mine.path  # never one made before
        alive.send_signal(signal.SIGKILL)
        alive.wait(timeout=60)
        mine.remove()
        assert not mine.path.exists() and not live.exists() and same_process.path.is_dir()
    finally:
        for proc in (killed, alive):
            proc.kill()
            proc.wait(timeout=60)


def test_a_file_rewritten_while_it_is_copied_is_never_part_of_a_checkpoint(tmp_path, monkeypatch):
    """Issue: the files taken earlier were copied into each checkpoint from the live folder
    after a look at their size and time, never after the copy: one rewritten during the copy
    was committed torn, with a hash that matched the torn copy. Now the copy is checked after
    (the open file's fstat and its path): a torn one is never handed over, that checkpoint is
    not committed, and the next one takes the file once it is closed and still again."""
    from orchestrator.checkpoint.committer import Committer
    from orchestrator.checkpoint.store import CheckpointStore
    from orchestrator.storage.location import StorageSpec
    from trainers.script import files

    SIZE = 1 << 16  # more than a buffered read takes at once: the copy really tears
    user = tmp_path / "user"
    user.mkdir()
    patterns = ["model.pt", "rng.pt"]
    work, ckpt = make_node_folder(tmp_path / "node", user, patterns)
    watcher = CheckpointWatcher(work, ckpt, patterns, tmp_path / "pending")
    (work / "rng.pt").write_bytes(b"r" * SIZE)
    os.utime(work / "rng.pt", ns=(10**18, 10**18))  # written a while ago, as a still file was
    (work / "model.pt").write_bytes(b"1" * SIZE)
    assert not watcher.poll() and watcher.poll()
    store = CheckpointStore(StorageSpec(str(tmp_path / "run")))
    failures = []
    committer = Committer(store, 0, 1, "att", asynchronous=False,
                          on_failure=lambda step, exc: failures.append(str(exc)))

    def save(step):
        folder = tmp_path / f"step_{step}"
        folder.mkdir()
        committer.snapshot(step, folder, {"step": step}, pending=watcher.write_into(folder, 0))

    def committed(step):
        (ref,) = [r for r in store.committed() if r.step == step]
        return store.load(ref)[0]

    save(1)
    assert committed(1) == {"node_0/work/model.pt": b"1" * SIZE,
                            "node_0/work/rng.pt": b"r" * SIZE}

    real_copy = files.copy_bytes
    torn = []

    def rewritten_mid_copy(name):
        def copy(source, dest):
            dest.write(source.read(100))  # the first bytes of the version taken
            if not torn:  # the script saves over it in place, the same size
                torn.append(name)
                with open(work / name, "r+b") as f:
                    f.write(b"X" * SIZE)
            real_copy(source, dest)
        return copy

    # A new model.pt, taken aside at a poll; rng.pt, unchanged since checkpoint 1, is
    # rewritten while the next checkpoint copies it.
    (work / "model.pt").write_bytes(b"2" * (SIZE + 1))
    assert not watcher.poll() and watcher.poll()
    monkeypatch.setattr(files, "copy_bytes", rewritten_mid_copy("rng.pt"))
    save(2)
    assert torn == ["rng.pt"] and [r.step for r in store.committed()] == [1]
    assert len(failures) == 1 and "rng.pt changed while it was being copied" in failures[0]
    # The new rng.pt is taken once closed and still, a whole copy, with model.pt's 2.
    monkeypatch.setattr(files, "copy_bytes", real_copy)
    assert not watcher.poll() and watcher.poll()
    save(3)
    assert committed(3) == {"node_0/work/model.pt": b"2" * (SIZE + 1),
                            "node_0/work/rng.pt": b"X" * SIZE}

    # A file rewritten while a poll copies it aside is not taken at that poll either.
    (work / "model.pt").write_bytes(b"3" * SIZE)
    os.utime(work / "model.pt", ns=(10**18, 10**18))
    torn.clear()
    monkeypatch.setattr(files, "copy_bytes", rewritten_mid_copy("model.pt"))
    assert not watcher.poll() and not watcher.poll() and not watcher.has_new()
    assert torn == ["model.pt"]
    monkeypatch.setattr(files, "copy_bytes", real_copy)
    assert not watcher.poll() and watcher.poll()  # the new version, once still
    save(4)
    assert committed(4)["node_0/work/model.pt"] == b"X" * SIZE


def test_a_script_runs_derived_name_says_its_script_not_the_default_data():
    """A minGPT script's run was named script-digits-<hash>: the data keys are not what a
    script trains on."""
    from orchestrator.driver.run_plan import derive_run_name
    from orchestrator.worker_api import training_info
    from trainers.script.run import main, script_label

    assert training_info(main).run_label is script_label
    trainer = {"name": "script", "command": "torchrun --nproc-per-node=2 mingpt/main.py x=1"}
    assert derive_run_name(trainer, {"name": "digits"}, 0, script_label(trainer)).startswith(
        "script-main-")
    assert script_label({"command": "python -m mypkg.train --epochs 1"}) == "mypkg.train"
    assert derive_run_name({"name": "ddp"}, {"name": "digits"}, 0).startswith("ddp-digits-")
