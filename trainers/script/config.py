"""trainer=script's keys and the checks made on the driver, before Ray starts."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.config.rules import require
from orchestrator.config.schema import TrainerConfig
from orchestrator.errors import ConfigError
from trainers.script.command import is_python, parse_command


@dataclass
class ScriptConfig(TrainerConfig):
    name: str = "script"
    fn: str = "trainers.script.run:main"
    backend: str = "none"  # the script initialises its own process group (env://)
    command: str = ""  # "python train.py ..." or "torchrun --nproc-per-node=2 train.py ..."
    # The script's checkpoint files, relative to workdir (globs allowed): put back before it
    # starts, taken as one checkpoint each time it writes them. Files it writes under
    # $CHECKPOINT_DIR are taken too.
    checkpoint_files: list[str] = field(default_factory=list)
    workdir: str = "."  # where the script runs (made absolute on the driver)
    poll_s: float = 0.25  # how often the checkpoint files are looked at
    # After SIGTERM (a preemption notice), how long the script may take to save and exit
    # when the notice has no deadline; with one, until shortly before it.
    term_grace_s: float = 30.0

    def __post_init__(self) -> None:
        require(self.poll_s > 0, "trainer.poll_s", self.poll_s, "a number of seconds > 0")
        require(self.term_grace_s > 0, "trainer.term_grace_s", self.term_grace_s,
                "a number of seconds > 0")


def check_script(cfg: dict) -> None:
    """The command names a script that exists; checkpoint files stay inside workdir."""
    trainer = cfg["trainer"]
    workdir = Path(trainer["workdir"])
    if not workdir.is_dir():
        raise ConfigError(f"trainer.workdir={str(workdir)!r}: no such folder")
    command = parse_command(trainer["command"])
    where = ("this folder" if workdir.resolve() == Path.cwd().resolve()
             else f"trainer.workdir={str(workdir)!r}")
    if command.script is not None and "$" not in command.script:  # $NAME: the worker's to expand
        script = workdir / command.script
        if not script.is_file():
            raise ConfigError(f"trainer.command={trainer['command']!r}: the script "
                              f"{command.script!r} does not exist in {where}")
    program = command.argv[0]
    if not is_python(program) and "$" not in program:  # a program of its own: ./run.sh, or on PATH
        if "/" in program and not os.access(workdir / program, os.X_OK):
            raise ConfigError(f"trainer.command={trainer['command']!r}: {program!r} in {where} "
                              "is not executable (chmod +x it, or run it as bash/python "
                              f"{program})")
        if "/" not in program and shutil.which(program) is None:
            raise ConfigError(f"trainer.command={trainer['command']!r}: the program "
                              f"{program!r} is not on PATH")
    for pattern in trainer["checkpoint_files"]:
        check_checkpoint_pattern(str(pattern))


def check_checkpoint_pattern(pattern: str) -> None:
    parts = Path(pattern).parts
    if not parts or not pattern.strip() or Path(pattern).is_absolute() or ".." in parts or \
            os.path.expanduser(pattern) != pattern:
        raise ConfigError(f"trainer.checkpoint_files: {pattern!r} is not allowed: a path or glob "
                          "relative to trainer.workdir, inside it (snapshot.pt, ckpt/*.pt)")
    if len(parts) > 1 and any(c in parts[0] for c in "*?["):
        # The entries a pattern's first part matches are the run's own, not links to yours:
        # */x.pt or **/*.pt would hide every folder, the script's code with them.
        raise ConfigError(f"trainer.checkpoint_files: {pattern!r} is not allowed: name its first "
                          "folder (ckpt/*.pt, ckpt/**/*.pt), whose files are the checkpoint's")


NCCL = re.compile(r"""backend\s*=\s*["']nccl["']|init_process_group\(\s*["']nccl["']""")


def hard_coded_nccl(script: Path) -> bool:
    """Does the script ask for nccl by name, with no way to gloo? (It cannot start on
    workers without GPUs.) `"nccl" if torch.cuda.is_available() else "gloo"` can."""
    try:
        lines = script.read_text(errors="replace").splitlines()
    except OSError:
        return False
    code = "\n".join(line.split("#", 1)[0] for line in lines)  # comments are not code
    return bool(NCCL.search(code)) and "gloo" not in code
