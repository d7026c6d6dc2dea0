"""trainer.command: the script's command line, as a user types it for python or torchrun.

``python train.py 50 10`` runs as given. ``torchrun --nproc-per-node=2 train.py 50 10`` is
read the way torchrun reads it: its flags size the run (``--nnodes`` times
``--nproc-per-node`` workers; a range ``--nnodes=1:4`` makes it elastic) and the rest is the
script's. Rendezvous, master address and port are the orchestrator's to choose.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.errors import ConfigError

TORCHRUN = ("torchrun", "torch.distributed.run", "torch.distributed.launch")
PYTHONS = ("python", "python3")
# torchrun's flags that take a value (both spellings: --nproc-per-node and --nproc_per_node).
VALUE_FLAGS = {"nnodes", "nproc-per-node", "rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf",
               "max-restarts", "monitor-interval", "start-method", "role", "node-rank",
               "master-addr", "master-port", "local-addr", "log-dir", "redirects", "tee",
               "local-ranks-filter", "logs-specs", "rdzv-timeout", "event-log-handler",
               "numa-binding", "signals-to-handle", "r", "t"}
BOOL_FLAGS = {"standalone", "no-python", "run-path", "module", "m", "virtual-local-rank"}


@dataclass(frozen=True)
class ScriptCommand:
    argv: list[str]  # what each worker runs ("python" stands for the workers' interpreter)
    script: str | None  # the script file, relative to the working directory (None: a module)
    nproc_per_node: int | None = None  # torchrun's flags, when it was a torchrun command
    nnodes: tuple[int, int] | None = None
    torchrun_flags: dict = field(default_factory=dict)

    @property
    def workers(self) -> tuple[int, int] | None:
        """(min, max) workers torchrun's flags ask for, or None."""
        if self.nproc_per_node is None and self.nnodes is None:
            return None
        per_node = self.nproc_per_node or 1
        low, high = self.nnodes or (1, 1)
        return low * per_node, high * per_node


def parse_command(command: str) -> ScriptCommand:
    try:
        argv = shlex.split(command or "")
    except ValueError as exc:
        raise ConfigError(f"trainer.command={command!r} cannot be read as a command line: {exc}") \
            from None
    if not argv:
        raise ConfigError("trainer.command: a value is required: the command that runs your "
                          "script, e.g. trainer.command=\"python train.py --epochs 10\"")
    if launcher(argv) is not None:
        return torchrun_command(argv, command)
    return plain_command(argv, command)


def launcher(argv: list[str]) -> int | None:
    """How many words name torchrun (``torchrun``, ``python -m torch.distributed.run``)."""
    if Path(argv[0]).name == "torchrun":
        return 1
    if Path(argv[0]).name in PYTHONS and len(argv) >= 3 and argv[1] == "-m" and argv[2] in TORCHRUN:
        return 3
    return None


def plain_command(argv: list[str], command: str) -> ScriptCommand:
    if Path(argv[0]).name not in PYTHONS:
        return ScriptCommand(argv, argv[0] if "/" in argv[0] else None)  # a program of its own
    i = 1
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] == "-m":
            return ScriptCommand(argv, None)
        i += 1 + (argv[i] in ("-W", "-X", "-c"))  # python's flags that take a value
    if i >= len(argv):
        raise ConfigError(f"trainer.command={command!r} names no script: python <script.py> ...")
    return ScriptCommand(argv, argv[i])


def torchrun_command(argv: list[str], command: str) -> ScriptCommand:
    flags: dict[str, str | bool] = {}
    i = launcher(argv) or 1
    while i < len(argv) and argv[i].startswith("-"):
        name, eq, value = argv[i].lstrip("-").partition("=")
        name = name.replace("_", "-")
        if name in VALUE_FLAGS:
            if not eq:
                i += 1
                if i >= len(argv):
                    raise ConfigError(f"trainer.command={command!r}: torchrun's --{name} needs "
                                      "a value")
                value = argv[i]
            flags[name] = value
        elif name in BOOL_FLAGS:
            flags[name] = True
        else:
            raise ConfigError(f"trainer.command={command!r}: --{name} is not a torchrun flag "
                              "(see torchrun --help)")
        i += 1
    rest = argv[i:]
    if not rest:
        raise ConfigError(f"trainer.command={command!r} names no script after torchrun's flags")
    nproc = positive(flags.get("nproc-per-node"), "--nproc-per-node", command)
    nnodes = node_range(flags.get("nnodes"), command)
    if flags.get("no-python"):
        script_argv, script = rest, rest[0] if "/" in rest[0] else None
    elif flags.get("module") or flags.get("m"):
        script_argv, script = ["python", "-m", *rest], None
    else:
        script_argv, script = ["python", *rest], rest[0]
    return ScriptCommand(script_argv, script, nproc, nnodes, flags)


def positive(value, flag: str, command: str) -> int | None:
    if value is None:
        return None
    if str(value) in ("auto", "cpu", "gpu"):
        raise ConfigError(f"trainer.command={command!r}: {flag}={value} is not allowed here: a "
                          "number (the workers come from Ray: set cluster.workers instead)")
    if not str(value).isdigit() or int(value) < 1:
        raise ConfigError(f"trainer.command={command!r}: {flag}={value} is not allowed: an "
                          "integer >= 1")
    return int(value)


def node_range(value, command: str) -> tuple[int, int] | None:
    if value is None:
        return None
    low, _, high = str(value).partition(":")
    low_n = positive(low, "--nnodes", command)
    high_n = positive(high, "--nnodes", command) if high else low_n
    if high_n < low_n:
        raise ConfigError(f"trainer.command={command!r}: --nnodes={value} is not allowed: MIN:MAX "
                          "with MIN <= MAX")
    return low_n, high_n


def cluster_from_command(trainer: dict, cluster: dict, given: set[str]) -> dict:
    """cluster.workers (and min_workers, for a range of nodes) from torchrun's flags; a
    cluster key given on the command line that says otherwise is refused. A script that
    asks for nccl by name on workers without GPUs is refused here too."""
    command = parse_command(str(trainer.get("command") or ""))
    if command.script is not None and not cluster.get("gpus_per_worker"):
        from trainers.script.config import hard_coded_nccl

        if hard_coded_nccl(Path(str(trainer.get("workdir") or ".")) / command.script):
            raise ConfigError(
                f"trainer.command={trainer.get('command')!r}: {command.script} asks for the nccl "
                "backend, which needs GPUs, and cluster.gpus_per_worker=0: give the workers "
                "GPUs (cluster.gpus_per_worker=1) or use gloo on CPU")
    sized = command.workers
    if sized is None:
        return {}
    low, high = sized
    wanted = {"workers": high, "min_workers": low if low != high else None}
    for key, value in wanted.items():
        if key in given and cluster.get(key) != value:
            raise ConfigError(
                f"cluster.{key}={cluster.get(key)} contradicts trainer.command's torchrun flags "
                f"({describe(command)}: {key}={value}): give one of them")
    return wanted


def describe(command: ScriptCommand) -> str:
    parts = []
    if command.nnodes is not None:
        low, high = command.nnodes
        parts.append(f"--nnodes={low}" if low == high else f"--nnodes={low}:{high}")
    if command.nproc_per_node is not None:
        parts.append(f"--nproc-per-node={command.nproc_per_node}")
    return " ".join(parts)
