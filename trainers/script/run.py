"""trainer=script: run the user's torchrun-style script on every worker, unchanged.

Each Ray worker starts the script as its child, with the environment torchrun gives (RANK,
WORLD_SIZE, MASTER_ADDR... fresh for every attempt), then supervises it in lockstep with the
other workers, a poll every trainer.poll_s:
- the script runs in a folder of this user's alone, new for every attempt on every node
  (folders.py); checkpoints are put back there before it starts;
- the script's output goes to the run folder (rank 0's to the console too);
- when rank 0's node sees the checkpoint files written (closed and still), every rank hands
  its node's files over as its part of one checkpoint (orchestrator/checkpoint: committed only
  once every part is stored; a rank that died has no part, so nothing it tore is committed);
- a rank whose script fails fails the attempt: the group restarts from the newest committed
  checkpoint, which is put back where the script looks for it;
- a preemption notice sends SIGTERM to every rank's script at once; what they write before
  they exit is committed before the node goes.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
import uuid
from pathlib import Path

from orchestrator.worker_api import WorkerContext, training_function
from trainers.script.command import cluster_from_command, parse_command
from trainers.script.config import ScriptConfig, check_script
from trainers.script.files import (
    CKPT_DIR,
    WORK,
    CheckpointWatcher,
    keep_new_entries,
    make_node_folder,
    outside_paths_absolute,
    restore_files,
)
from trainers.script.folders import NodeFolder, folder_prefix, node_folder_made, script_base
from trainers.script.process import ScriptProcess

CHECK_EVERY = 4  # polls between preemption checks (every rank: a barrier)
DEADLINE_MARGIN_S = 3.0  # SIGKILL this long before a notice's deadline: time to upload


class ScriptFailed(RuntimeError):
    """A rank's script exited non-zero or was killed. ``details``, the end of its stderr,
    stands for the traceback in what the run reports (the supervisor's own says nothing)."""

    def __init__(self, message: str, details: str | None = None):
        super().__init__(message)
        self.details = details


def failed(proc: ScriptProcess, code: int) -> ScriptFailed:
    tail = "\n".join(proc.stderr_tail)
    return ScriptFailed(proc.failure(code), f"the end of rank {proc.rank}'s stderr:\n{tail}\n"
                        if tail else None)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_address() -> str:
    import ray

    return ray.util.get_node_ip_address()


def script_label(trainer: dict) -> str:
    """What a derived run name says a script run trains on: its script's name (or module's)."""
    command = parse_command(str(trainer["command"]))
    if command.script:
        return Path(command.script).stem
    return command.argv[command.argv.index("-m") + 1] if "-m" in command.argv else "script"


@training_function(config=ScriptConfig, check=check_script, step_unit="checkpoint",
                   cluster=cluster_from_command, run_label=script_label)
def main(ctx: WorkerContext, cfg: dict) -> dict | None:
    trainer = cfg["trainer"]
    first = None
    if ctx.rank == 0:
        host = node_address()
        first = {"attempt": uuid.uuid4().hex[:8], "addr": host, "port": free_port(host),
                 "restarts": ctx.groups_before()}
    first = ctx.broadcast(first)
    first["nodes"] = int(ctx.sum_over_ranks([ctx.local_rank == 0])[0])  # torchrun's agents
    ctx.total_steps = None  # the group has started (the display counts checkpoints)
    prefix = folder_prefix(ctx.run_name, first["attempt"], ctx.node_rank)
    # made by the node's local rank 0 (the others find it after the barrier below)
    folder = NodeFolder(script_base(), prefix) if ctx.local_rank == 0 else None
    try:
        return run_script(ctx, trainer, first, folder, prefix)
    finally:
        if folder is not None:  # this node's folder only: nodes may share a /tmp
            folder.remove()


def run_script(ctx: WorkerContext, trainer: dict, first: dict, folder: NodeFolder | None,
               prefix: str) -> dict | None:
    command = parse_command(trainer["command"])
    patterns = [str(p) for p in trainer["checkpoint_files"]]
    watcher = None
    if folder is not None:
        root = folder.path
        work, ckpt = make_node_folder(root, Path(trainer["workdir"]), patterns)
        # this node's files, over node 0's (a snapshot rank 0 wrote is every node's)
        restored = ctx.restore([f"node_{ctx.node_rank}/*", "node_0/*"])
        borrowed = restore_files(restored, ctx.node_rank, work, ckpt, patterns) \
            if restored is not None else set()
        watcher = CheckpointWatcher(work, ckpt, patterns, root / "pending", borrowed=borrowed)
    if ctx.rank == 0 and first["restarts"] and not ctx.start_step:
        ctx.warn("the script restarted from the beginning: it wrote no checkpoint files "
                 f"(trainer.checkpoint_files={patterns}, or files under $CHECKPOINT_DIR)")
    ctx.broadcast(None)  # every node's folder is ready before any script starts
    root = folder.path if folder is not None else node_folder_made(script_base(), prefix)
    work, ckpt = root / WORK, root / CKPT_DIR
    given = script_env(ctx, first, trainer, work, ckpt, root)
    env = {**given, **{k: expand(v, given) for k, v in command.env.items()}}
    argv = [expand(arg, given) for arg in
            outside_paths_absolute(command.argv_for(ctx.local_rank), Path(trainer["workdir"]))]
    proc = ScriptProcess(argv, env, work, ctx.rank, root / f"error_rank{ctx.rank}.json")
    try:
        return Supervisor(ctx, proc, watcher, trainer).run(root)
    finally:
        if proc.poll() is None:
            proc.kill()
        ctx.output(proc.take_lines())
        if folder is not None:
            keep_new_entries(work, Path(trainer["workdir"]), patterns)


VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)\}")


def expand(word: str, env: dict[str, str]) -> str:
    """``{checkpoint_dir}``, and ``$NAME`` / ``${NAME}`` of the script's environment, as a
    shell would have given them (the command is not run by one); an unknown name stays."""
    word = word.replace("{checkpoint_dir}", env["CHECKPOINT_DIR"])
    return VARIABLE.sub(lambda m: env.get(m.group(1) or m.group(2), m.group(0)), word)


def script_env(ctx: WorkerContext, first: dict, trainer: dict, work: Path, ckpt: Path,
               root: Path) -> dict[str, str]:
    """What torchrun gives each process, plus $CHECKPOINT_DIR."""
    env = dict(os.environ)
    env.update({
        "RANK": str(ctx.rank), "LOCAL_RANK": str(ctx.local_rank),
        "WORLD_SIZE": str(ctx.world_size), "LOCAL_WORLD_SIZE": str(ctx.local_world_size),
        "GROUP_RANK": str(ctx.node_rank), "ROLE_RANK": str(ctx.rank),
        "ROLE_WORLD_SIZE": str(ctx.world_size), "ROLE_NAME": "default",
        "GROUP_WORLD_SIZE": str(first["nodes"]),
        "MASTER_ADDR": first["addr"], "MASTER_PORT": str(first["port"]),
        "TORCHELASTIC_RESTART_COUNT": str(first["restarts"]),
        "TORCHELASTIC_MAX_RESTARTS": str(ctx.max_restarts),
        "TORCHELASTIC_RUN_ID": ctx.run_name,
        "TORCHELASTIC_ERROR_FILE": str(root / f"error_rank{ctx.rank}.json"),
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "CHECKPOINT_DIR": str(ckpt),
        "ORCHESTRATOR_METRICS_FILE": str(root / f"metrics_rank{ctx.rank}.json"),
        "PYTHONUNBUFFERED": "1",
    })
    return env


class Supervisor:
    def __init__(self, ctx: WorkerContext, proc: ScriptProcess, watcher: CheckpointWatcher | None,
                 trainer: dict):
        self.ctx, self.proc, self.watcher = ctx, proc, watcher
        self.poll_s = float(trainer["poll_s"])
        self.term_grace_s = float(trainer["term_grace_s"])
        self.checkpoints = ctx.start_step  # checkpoint numbers go on across attempts

    def run(self, root: Path) -> dict | None:
        ctx, proc = self.ctx, self.proc
        polls = 0
        while True:
            code = proc.poll()
            if code is not None and code != 0:
                raise failed(proc, code)
            ctx.output(proc.take_lines())
            ready = self.watcher.poll() if self.watcher is not None else False
            decision = ctx.broadcast({"save": ready, "done": code == 0} if ctx.rank == 0 else None)
            if decision["save"]:
                self.save()
            if decision["done"]:
                return self.finish(root)
            polls += 1
            if polls % CHECK_EVERY == 0 and ctx.check_preemption():
                return self.preempted()
            time.sleep(self.poll_s)

    def save(self) -> None:
        self.checkpoints += 1
        watcher, node = self.watcher, self.ctx.node_rank
        self.ctx.save(self.checkpoints,
                      lambda folder: watcher.write_into(folder, node) if watcher else None)
        self.ctx.step_done(self.checkpoints)

    def settle(self, clean: bool) -> None:
        """After the scripts exited: one more checkpoint if rank 0's node has new files."""
        new = False
        if self.watcher is not None:
            new = self.watcher.poll(settled=clean)
        if self.ctx.broadcast(new if self.ctx.rank == 0 else None):
            self.save()

    def finish(self, root: Path) -> dict | None:
        code = self.proc.wait()
        self.ctx.output(self.proc.take_lines())
        if code != 0:
            raise failed(self.proc, code)
        self.settle(clean=True)
        if self.ctx.rank == 0 and self.checkpoints == 0:
            self.ctx.warn("the script wrote no checkpoint files (trainer.checkpoint_files, or "
                          "files under $CHECKPOINT_DIR): a restart would begin from the start")
        return read_metrics(root / f"metrics_rank{self.ctx.rank}.json") if self.ctx.rank == 0 \
            else None

    def preempted(self) -> None:
        """SIGTERM now (every rank got the notice at this barrier); wait for the scripts to
        save and exit, SIGKILL shortly before the deadline; commit what they wrote."""
        deadline = self.ctx.preemption_deadline
        grace = deadline - time.time() - DEADLINE_MARGIN_S if deadline else self.term_grace_s
        self.proc.signal(signal.SIGTERM)
        code = self.proc.wait(timeout=max(grace, 0.0))
        if code is None:
            self.proc.kill()
        self.ctx.output(self.proc.take_lines())
        # Killed (by the SIGTERM, or the SIGKILL after it), a script may have torn the file it
        # was writing: only files seen closed and still before are taken then.
        self.settle(clean=code == 0)
        return None


def read_metrics(path: Path) -> dict | None:
    """$ORCHESTRATOR_METRICS_FILE: a JSON object of final metrics rank 0's script may write."""
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return {str(k): float(v) for k, v in data.items() if isinstance(v, (int, float))}
