"""What every benchmark shares: timed subprocesses, side-by-side interleaving, medians, ratios
and goals. Pure helpers are kept apart from the ones that start processes, so the former can be
tested without Ray."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
PYTHON = sys.executable
ORCHESTRATOR = [PYTHON, "-m", "orchestrator"]
BASELINES = REPO / "scripts" / "baselines"


# -- pure helpers ------------------------------------------------------------------------
def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


def paired_ratios(ours: list[float], theirs: list[float]) -> list[float | None]:
    """Ratio of each interleaved pair (the same repeat ran on a machine in the same state)."""
    return [ratio(a, b) for a, b in zip(ours, theirs, strict=True)]


@dataclass(frozen=True)
class Goal:
    """`value <op> target`, e.g. Goal(">=", 0.97)."""

    op: str
    target: float

    def met(self, value: float | None) -> bool | None:
        if value is None:
            return None
        return value >= self.target if self.op == ">=" else value <= self.target

    def __str__(self) -> str:
        return f"{self.op} {self.target:g}"


def figure(value: float | None, goal: Goal | None = None, **extra) -> dict:
    """One headline figure of a benchmark: its value, the goal, whether it was met."""
    out = {"value": value, **extra}
    if goal is not None:
        out.update(goal=str(goal), met=goal.met(value))
    return out


def order_for(repeat: int, sides: list[str]) -> list[str]:
    """A B C, then C B A, ...: which side goes first alternates between repeats."""
    return list(sides) if repeat % 2 == 0 else list(reversed(sides))


def interleave(sides: dict[str, Callable[[int], dict]], repeats: int,
               log: Callable[[str], None] | None = None) -> dict[str, list[dict]]:
    """Run each side once per repeat, alternating which goes first; results per side."""
    results: dict[str, list[dict]] = {name: [] for name in sides}
    for repeat in range(repeats):
        for name in order_for(repeat, list(sides)):
            started = time.time()
            results[name].append(sides[name](repeat))
            if log:
                log(f"{name} #{repeat}: {time.time() - started:.1f}s")
    return results


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def progress(message: str) -> None:
    print(f"[bench] {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


# -- processes -----------------------------------------------------------------------------
def bench_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # never join someone else's cluster
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@dataclass
class Timed:
    started_at: float  # time.time() just before the process was started
    ended_at: float
    returncode: int
    output: str

    @property
    def wall_s(self) -> float:
        return round(self.ended_at - self.started_at, 3)


def run_timed(cmd: list[str], log_path: Path, timeout: float = 900, env: dict | None = None,
              check: bool = True, cwd: Path = REPO) -> Timed:
    """Run a command to its end; its output goes to log_path."""
    started = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=cwd, env=bench_env(env), stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout)
    ended = time.time()
    output = log_path.read_text()
    if check and proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{output[-3000:]}")
    return Timed(started, ended, proc.returncode, output)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def orchestrator_cmd(run_dir: Path, *overrides: str) -> list[str]:
    # A free dashboard port: with its fixed default (8265) the run fails when another Ray on
    # this shared machine holds that port (include_dashboard=True raises).
    return [*ORCHESTRATOR, f"hydra.run.dir={run_dir}", f"storage.uri={run_dir / 'ckpt'}",
            f"cluster.dashboard_port={free_port()}", *overrides]


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def first_step_at(record: dict) -> float | None:
    """Absolute time (epoch seconds) of the run's first finished step."""
    if record.get("time_to_first_step_s") is None:
        return None
    return record["started_at"] + record["time_to_first_step_s"]
