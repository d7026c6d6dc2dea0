"""trainer.command: the script's command line, as a user types it for python or torchrun.

``python train.py 50 10`` runs as given. ``torchrun --nproc-per-node=2 train.py 50 10`` is
read the way torchrun reads it: its flags size the run (``--nnodes`` times
``--nproc-per-node`` workers; a range ``--nnodes=1:4`` makes it elastic) and the rest is the
script's. Rendezvous, master address and port are the orchestrator's to choose.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.errors import ConfigError

TORCHRUN = ("torchrun", "torch.distributed.run", "torch.distributed.launch")
PYTHON = re.compile(r"python(\d+(\.\d+)?)?")  # python, python3, python3.11
PYTHON_VALUE_FLAGS = ("-W", "-X", "-c")  # python's own flags that take a value
# torchrun's flags that take a value (both spellings: --nproc-per-node and --nproc_per_node),
# those of torch 2.13's torchrun.
VALUE_FLAGS = {"nnodes", "nproc-per-node", "rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf",
               "max-restarts", "monitor-interval", "start-method", "role", "node-rank",
               "master-addr", "master-port", "local-addr", "log-dir", "redirects", "tee",
               "local-ranks-filter", "duplicate-stdout-filters", "duplicate-stderr-filters",
               "logs-specs", "event-log-handler", "numa-binding", "signals-to-handle",
               "shutdown-timeout", "r", "t"}
DEVICE_COUNTS = ("auto", "cpu", "gpu")  # --nproc-per-node: as many as the node has
BOOL_FLAGS = {"standalone", "no-python", "run-path", "module", "m", "virtual-local-rank"}
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
# What each worker's script is given (trainers/script/run.py's script_env): not the command's.
ORCHESTRATORS_OWN = ("CUDA_VISIBLE_DEVICES", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                     "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                     "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                     "CHECKPOINT_DIR", "ORCHESTRATOR_METRICS_FILE")


@dataclass(frozen=True)
class ScriptCommand:
    argv: list[str]  # what each worker runs ("python" stands for the workers' interpreter)
    script: str | None  # the script file, relative to the working directory (None: a module)
    nproc_per_node: int | None = None  # torchrun's flags, when it was a torchrun command
    nnodes: tuple[int, int] | None = None
    torchrun_flags: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)  # NAME=value words before the command
    launcher: str | None = None  # torchrun, torch.distributed.run or torch.distributed.launch
    args_at: int = 0  # where the script's own arguments begin in argv (a torchrun line)

    def argv_for(self, local_rank: int) -> list[str]:
        """What a worker runs: torch.distributed.launch gives the script --local-rank=N first
        (unless --use-env), as its own launcher does."""
        if self.launcher != "torch.distributed.launch" or self.torchrun_flags.get("use-env"):
            return list(self.argv)
        return [*self.argv[:self.args_at], f"--local-rank={local_rank}", *self.argv[self.args_at:]]

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
    env = leading_assignments(argv, command)
    argv = argv[len(env):]
    if not argv:
        raise ConfigError("trainer.command: a value is required: the command that runs your "
                          "script, e.g. trainer.command=\"python train.py --epochs 10\"")
    operator = shell_operator(command)
    if operator is not None:
        raise ConfigError(f"trainer.command={command!r}: {operator} is a shell's, and the "
                          "command is not run by a shell: give the command alone (its "
                          "output is kept in the run folder)")
    named = launcher(argv)
    parsed = torchrun_command(argv, command, named) if named is not None else \
        plain_command(argv, command)
    return ScriptCommand(parsed.argv, parsed.script, parsed.nproc_per_node, parsed.nnodes,
                         parsed.torchrun_flags, env, named and argv[named - 1], parsed.args_at)


def shell_operator(command: str) -> str | None:
    """The first pipe, list, redirection or substitution outside quotes (``10|tee log``,
    ``3; python eval.py``, ``2>&1``, ``$(date)``), said with its word; a quoted or escaped
    one (``--sep '|'``) is a value."""
    quote, i = None, 0
    while i < len(command):
        char = command[i]
        if char == "\\" and quote != "'":
            i += 2  # an escaped character is the word's
            continue
        if quote is not None:
            if char == quote:
                quote = None
            elif quote == '"' and (char == "`" or command.startswith("$(", i)):
                return operator_in_word(command, i, "`" if char == "`" else "$(")
        elif char in "'\"":
            quote = char
        elif char in "|&;<>`" or command.startswith("$(", i):
            return operator_in_word(command, i, "$(" if char == "$" else char)
        i += 1
    return None


def operator_in_word(command: str, at: int, operator: str) -> str:
    start = max(command.rfind(" ", 0, at), command.rfind("\t", 0, at)) + 1
    end = min((j for j in (command.find(" ", at), command.find("\t", at)) if j >= 0),
              default=len(command))
    word = command[start:end]
    return repr(operator) if word == operator else f"{operator!r} in {word!r}"


def leading_assignments(argv: list[str], command: str) -> dict[str, str]:
    """``OMP_NUM_THREADS=4 torchrun ...``: the script's environment, as a shell gives it."""
    env: dict[str, str] = {}
    for word in argv:
        match = ASSIGNMENT.match(word)
        if not match:
            break
        name, value = match.groups()
        if name in ORCHESTRATORS_OWN or name.startswith("TORCHELASTIC_"):
            how = " (GPUs: cluster.gpus_per_worker)" if name == "CUDA_VISIBLE_DEVICES" else ""
            raise ConfigError(f"trainer.command={command!r}: {name} is set for each worker by "
                              f"the orchestrator{how}: leave it out")
        env[name] = value
    return env


def is_python(word: str) -> bool:
    return PYTHON.fullmatch(Path(word).name) is not None


def launcher(argv: list[str]) -> int | None:
    """How many words name torchrun (``torchrun``, ``python -u -m torch.distributed.run``)."""
    if Path(argv[0]).name == "torchrun":
        return 1
    if not is_python(argv[0]):
        return None
    i = 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-m":
        i += 1 + (argv[i] in PYTHON_VALUE_FLAGS)
    if i + 1 < len(argv) and argv[i] == "-m" and argv[i + 1] in TORCHRUN:
        return i + 2
    return None


def plain_command(argv: list[str], command: str) -> ScriptCommand:
    if not is_python(argv[0]):
        wrapped = next((w for w in argv[1:] if Path(w).name == "torchrun" or w in TORCHRUN), None)
        if wrapped is not None:
            # uv run torchrun ..., env X=1 torchrun ...: every worker would start a torchrun
            # of its own, with its own ranks.
            raise ConfigError(f"trainer.command={command!r}: {wrapped} inside another program "
                              f"({argv[0]}) is not read: give the torchrun line itself "
                              "(NAME=value before it sets the script's environment)")
        return ScriptCommand(argv, argv[0] if "/" in argv[0] else None)  # a program of its own
    i = 1
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] in ("-m", "-c"):  # a module, or code on the command line: no script file
            return ScriptCommand(argv, None)
        i += 1 + (argv[i] in PYTHON_VALUE_FLAGS)
    if i >= len(argv):
        raise ConfigError(f"trainer.command={command!r} names no script: python <script.py> ...")
    return ScriptCommand(argv, argv[i])


def torchrun_command(argv: list[str], command: str, start: int) -> ScriptCommand:
    flags: dict[str, str | bool] = {}
    i = start
    legacy = argv[start - 1] == "torch.distributed.launch"
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] == "--":  # the end of torchrun's flags
            i += 1
            break
        name, eq, value = argv[i].lstrip("-").partition("=")
        name = name.replace("_", "-")
        if not argv[i].startswith("--") and len(name) > 1 and name[0] in "rt" and not eq:
            name, eq, value = name[0], "=", name[1:]  # -r3: a short flag and its value
        if name == "use-env" and legacy:
            flags[name] = True
        elif name in VALUE_FLAGS:
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
    args_at = len(script_argv) - len(rest) + 1
    return ScriptCommand(script_argv, script, nproc, nnodes, flags, args_at=args_at)


def positive(value, flag: str, command: str) -> int | None:
    if value is None or (flag == "--nproc-per-node" and str(value) in DEVICE_COUNTS):
        return None  # the size is cluster.workers' (cluster_from_command)
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
    per_node = command.torchrun_flags.get("nproc-per-node")
    if per_node in DEVICE_COUNTS:
        if "workers" not in given:
            raise ConfigError(
                f"trainer.command={trainer.get('command')!r}: --nproc-per-node={per_node} "
                "counts a node's devices, which Ray places: give cluster.workers=N with it, or "
                "a number")
        return {}
    sized = command.workers
    if sized is None:
        # A torchrun line without size flags starts one process, torchrun's default; a
        # cluster.workers given with it sizes the run.
        return {"workers": 1} if command.launcher and "workers" not in given else {}
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
