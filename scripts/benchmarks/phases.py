"""Where a driver's time goes: run a Python command with timers around the calls that matter
(imports of the heavy packages, ray.init, the trainer's fit, ray.shutdown, the orchestrator's
own steps) and write them as JSON, relative to the process start.

    python scripts/benchmarks/phases.py OUT.json -m orchestrator trainer.epochs=1
    python scripts/benchmarks/phases.py OUT.json scripts/baselines/ray_train_ddp.py --epochs 1
"""

from __future__ import annotations

import atexit
import builtins
import functools
import importlib
import json
import runpy
import sys
import time
from pathlib import Path

HEAVY = ("torch", "ray", "hydra", "sklearn", "ray.train.torch", "pyarrow", "xgboost", "lightgbm")
PATCH = (  # (module, attribute path, label): wrapped once the module is imported
    ("ray", "init", "ray.init"),
    ("ray", "shutdown", "ray.shutdown"),
    ("ray.train.v2.api.data_parallel_trainer", "DataParallelTrainer.fit", "fit"),
    ("orchestrator.config.preflight", "check_command_line", "orchestrator.preflight"),
    ("orchestrator.driver.launch", "check_training", "orchestrator.check_training"),
    ("orchestrator.driver.launch", "make_plan", "orchestrator.make_plan"),
    ("orchestrator.driver.launch", "start_recorder", "orchestrator.start_recorder"),
    ("orchestrator.driver.launch", "launch", "orchestrator.driver.launch"),
)


def process_start() -> float:
    """This process's start (epoch seconds), from /proc: the interpreter's own start-up too."""
    ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime"))
    import os

    return boot + ticks / os.sysconf("SC_CLK_TCK")


T0 = process_start()
spans: list[dict] = []


def timed(label: str, fn):
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        start = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            spans.append({"what": label, "start_s": round(start - T0, 3),
                          "s": round(time.time() - start, 3)})
    return inner


def patch_loaded() -> None:
    for module_name, path, label in PATCH:
        module = sys.modules.get(module_name)
        owner_path, _, attr = path.rpartition(".")
        if module is None:
            continue
        try:  # a module still being imported may lack it yet: the next import tries again
            owner = functools.reduce(getattr, owner_path.split("."), module) if owner_path else module
            fn = getattr(owner, attr)
        except AttributeError:
            continue
        if not getattr(fn, "_phase_timed", False):
            wrapped = timed(label, fn)
            wrapped._phase_timed = True
            setattr(owner, attr, wrapped)


_import = builtins.__import__


def timed_import(name, globals=None, locals=None, fromlist=(), level=0):
    first = level == 0 and name in HEAVY and name not in sys.modules
    start = time.time()
    module = _import(name, globals, locals, fromlist, level)
    if first:
        spans.append({"what": f"import {name}", "start_s": round(start - T0, 3),
                      "s": round(time.time() - start, 3)})
    patch_loaded()
    return module


def write(out: str) -> None:
    Path(out).write_text(json.dumps({"process_start": T0, "exit_s": round(time.time() - T0, 3),
                                     "spans": sorted(spans, key=lambda s: s["start_s"])},
                                    indent=1))


def main() -> None:
    out, *cmd = sys.argv[1:]
    atexit.register(write, out)
    builtins.__import__ = timed_import
    importlib.invalidate_caches()
    if cmd[0] == "-m":
        sys.argv = [cmd[1], *cmd[2:]]
        runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = cmd
        runpy.run_path(cmd[0], run_name="__main__")


if __name__ == "__main__":
    main()
