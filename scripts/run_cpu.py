"""Where one run's CPU goes: every process of a command run on a fresh local head, by role.

    python scripts/run_cpu.py trainer.max_steps=50          # overrides of the command

Starts a `ray start --head` (scripts/local_cluster.py), runs `python -m orchestrator` with the
overrides against it once to warm it (the cluster's detached helpers start on its first run),
then again while sampling /proc every 0.1 s, and prints JSON: the second run's wall time and
the CPU seconds of each process it started, grouped by role (the driver; each Ray actor by its
class, from the `ray::<Class>` title a Ray worker takes; the head's own processes). Linux only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.local_cluster import node_env, start_head, stop_cluster  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def processes() -> dict[int, tuple[str, float]]:
    """pid -> (title, CPU seconds so far) of every process readable now."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline") as f:
                title = f.read().replace("\0", " ").strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        found[int(pid)] = (title, (int(fields[11]) + int(fields[12])) / TICK)
    return found


def named(title: str) -> bool:
    """A Ray worker's title once its actor started (ray::IDLE before and after)."""
    return title.startswith("ray::") and not title.startswith("ray::IDLE")


def role(title: str, driver_pid: int, pid: int) -> str:
    if pid == driver_pid:
        return "driver"
    if title.startswith("ray::"):
        return title.split()[0]
    if "default_worker.py" in title:
        return "ray worker (before its actor started)"
    return os.path.basename(title.split()[0]) if title else "(gone)"


def measure(address: str, cwd: Path, overrides: list[str]) -> dict:
    before = processes()
    seen: dict[int, tuple[str, float]] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for pid, (title, cpu) in processes().items():
                old = seen.get(pid, ("", 0.0))[0]
                seen[pid] = (title if named(title) or not named(old) and title else old, cpu)
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", f"cluster.address={address}",
                             f"storage.uri={cwd / 'ckpt'}", *overrides], cwd=cwd, env=node_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = proc.communicate()
    wall = time.perf_counter() - started
    time.sleep(1.0)
    stop.set()
    sampler.join()
    by_role: dict[str, float] = {}
    for pid, (title, cpu) in seen.items():
        spent = cpu - before.get(pid, ("", 0.0))[1]
        if spent >= 0.01:
            name = role(title, proc.pid, pid)
            by_role[name] = round(by_role.get(name, 0.0) + spent, 2)
    if proc.returncode != 0:
        print(output[-3000:], file=sys.stderr)
    return {"returncode": proc.returncode, "wall_s": round(wall, 2),
            "cpu_s": dict(sorted(by_role.items(), key=lambda kv: -kv[1])),
            "cpu_total_s": round(sum(by_role.values()), 2)}


def main() -> None:
    overrides = sys.argv[1:]
    tmp = Path(tempfile.mkdtemp(prefix="run-cpu-"))
    head = start_head(tmp)
    try:
        measure(head.address, tmp, overrides)  # warm: the cluster's first run
        print(json.dumps({"overrides": overrides, **measure(head.address, tmp, overrides)},
                         indent=1))
    finally:
        stop_cluster(head)


if __name__ == "__main__":
    main()
