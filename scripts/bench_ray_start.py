"""An embedded head's start (ray.init, as a command starts its own Ray) with and without Ray's
two fixed waits taken out (orchestrator/ray_internals/knobs.py CONNECT_RETRY, head_start.py's
registration wait):

    python scripts/bench_ray_start.py --repeats 5

The `ray_waits` side also leaves the raylet's agents at Ray's priority (head_start.py lowers
them in the same wait). The sides alternate, each a fresh Python process that imports Ray and
the orchestrator's head start, then times ray.init alone, with a command's options (2 CPUs, no
log monitor) and the dashboard beside the raylet, as a sweep's; the raylet's log gives how long
its store took to let it connect. Run it with nothing else on the machine. Prints one JSON
document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.benchmarks.common import loadavg  # noqa: E402
from scripts.local_cluster import free_port, node_env  # noqa: E402

START = r'''
import json, re, sys, time
import ray
from orchestrator.ray_internals import cluster, head_start, knobs
side = sys.argv[1]
config = dict(knobs.EMBEDDED_SYSTEM_CONFIG)
if side == "ray_waits":  # Ray's own: a 1 s retry of the store, a once-a-second ask
    for key in knobs.CONNECT_RETRY:
        config.pop(key)
    head_start.ray_node.Node.start_ray_processes = head_start._ray_start_ray_processes
began = time.monotonic()
with head_start.embedded_head(log_monitor=False, monitor=False):
    ray.init(address="local", num_cpus=2, include_dashboard=True, dashboard_host="127.0.0.1",
             dashboard_port=int(sys.argv[2]), log_to_driver=False, _system_config=config)
init_s = time.monotonic() - began
log = cluster.raylet_error_log().with_name("raylet.out").read_text()
stamps = [re.search(rf"^\[([^\]]+?) I [^\n]*{what}", log, re.M).group(1)
          for what in ("Plasma store debug dump", "ObjectManager server started")]
at = [time.mktime(time.strptime(t[:19], "%Y-%m-%d %H:%M:%S")) + int(t[20:]) / 1000 for t in stamps]
head_start.stopping()
ray.shutdown()
print(json.dumps({"init_s": round(init_s, 3), "store_connect_s": round(at[1] - at[0], 3)}))
'''

SIDES = ("orchestrator", "ray_waits")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    env = {k: v for k, v in node_env().items() if not k.startswith("RAY_raylet_client_")}
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    start_load = loadavg()
    for _ in range(args.repeats):
        for side in SIDES:
            done = subprocess.run([sys.executable, "-c", START, side, str(free_port())],
                                  capture_output=True, text=True, env=env, timeout=300,
                                  cwd=Path(__file__).resolve().parent.parent)
            if done.returncode != 0:
                raise SystemExit(f"{side}: {done.stderr[-2000:]}")
            runs[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
    medians = {side: {key: statistics.median(r[key] for r in runs[side])
                      for key in ("init_s", "store_connect_s")} for side in SIDES}
    print(json.dumps({"command": " ".join(["python", *sys.argv]), "repeats": args.repeats,
                      "loadavg_start": start_load, "loadavg_end": loadavg(),
                      "median": medians, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
