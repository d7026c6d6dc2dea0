"""Where one run's CPU goes on a joined cluster: every process of a command, by what it is.

    python scripts/run_cpu.py trainer.max_steps=50          # overrides of the command

Starts a `ray start --head` (scripts/local_cluster.py), runs `python -m orchestrator` with the
overrides against it once to warm it (the cluster's detached helpers start on its first run),
then again, and prints JSON: the second run's wall time and the CPU seconds it cost, per
process title (the driver's script; each Ray actor by its class). On a joined cluster the
actors are the head's descendants, not the driver's: both trees are watched, with
scripts/benchmarks/proctree.py's TreeWatcher (what `bench.py fixed_cost` reports for an
embedded cluster), the head's CPU from before the run left out. Linux only.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.benchmarks.proctree import TreeWatcher, cpu_s, summarize_cpu  # noqa: E402
from scripts.local_cluster import node_env, start_head, stop_cluster  # noqa: E402


def measure(head, cwd: Path, overrides: list[str]) -> dict:
    head_tree = TreeWatcher(head.process.pid, every_s=0.1)
    before = {pid: cpu_s(pid) for pid in head_tree.pids()}
    head_tree.start()
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", f"cluster.address={head.address}",
                             f"storage.uri={cwd / 'ckpt'}", *overrides], cwd=cwd, env=node_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    driver_tree = TreeWatcher(proc.pid, every_s=0.1).start()
    output, _ = proc.communicate()
    wall = time.perf_counter() - started
    time.sleep(1.0)  # the run's actors end with it: one more look at what they used
    driver_tree.stop()
    head_tree.stop()
    if proc.returncode != 0:
        print(output[-3000:], file=sys.stderr)
    cpu = {pid: used - before.get(pid, 0.0) for pid, used in head_tree.cpu.items()}
    cpu.update(driver_tree.cpu)
    titles = {**head_tree.titles, **driver_tree.titles}
    kinds = {**head_tree.kinds, **driver_tree.kinds}
    spent = summarize_cpu({p: s for p, s in cpu.items() if s >= 0.01}, kinds, titles)
    return {"returncode": proc.returncode, "wall_s": round(wall, 2), "cpu_total_s": spent["cpu_s"],
            "cpu_s_by_title": dict(sorted(spent["cpu_s_by_title"].items(), key=lambda kv: -kv[1]))}


def main() -> None:
    overrides = sys.argv[1:]
    tmp = Path(tempfile.mkdtemp(prefix="run-cpu-"))
    head = start_head(tmp)
    try:
        measure(head, tmp, overrides)  # warm: the cluster's first run
        print(json.dumps({"overrides": overrides, **measure(head, tmp, overrides)}, indent=1))
    finally:
        stop_cluster(head)
        shutil.rmtree(tmp, ignore_errors=True)  # its runs' outputs and checkpoints


if __name__ == "__main__":
    main()
