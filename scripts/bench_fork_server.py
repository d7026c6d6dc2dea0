"""Issue 30's lead, measured: Ray worker processes forked from a server that has Ray and torch
imported (orchestrator/ray_internals/fork_server/, which a sweep uses) against Ray's own
process start, on a `ray start --head` of this machine.

    python scripts/bench_fork_server.py --repeats 5

Each round creates two actors of one CPU whose constructor imports torch and ray.train.torch,
as a training worker does, and times them from the request until both answer; the sides
alternate, each in its own driver (job), and the fork server's side includes nothing of the
server's own start, which is timed apart (it would start once per job, beside the driver's
checks). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.ray_internals.torch_imports import TORCH_WARM  # noqa: E402
from scripts.benchmarks.common import loadavg  # noqa: E402
from scripts.local_cluster import node_env, start_head, stop_cluster  # noqa: E402

HERE = Path(__file__).resolve().parent.parent / "orchestrator" / "ray_internals" / "fork_server"
# Not ray.train.torch: Ray Data's import (through Ray Train's) seeds Ray's ID generator, and
# the server then refuses to serve (its server.py); the actors import it themselves.
PRELOAD = [name for name in TORCH_WARM if name.startswith("torch")]

DRIVER = r'''
import json, os, subprocess, sys, time
import ray
side, sock, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
server, server_s = None, None
if side == "fork_server":
    socket_name = next(n["RayletSocketName"] for n in ray.nodes() if n["Alive"])
    raylet = subprocess.run(["pgrep", "-f", f"raylet_socket_name={socket_name}"],
                            capture_output=True, text=True).stdout.split()[0]
    env = dict(os.environ, RAY_JOB_ID=ray.get_runtime_context().get_job_id(),
               RAY_RAYLET_PID=raylet)
    t = time.time()
    server = subprocess.Popen([sys.executable, "SERVER", sock, *PRELOAD], env=env,
                              stdout=subprocess.DEVNULL)
    while not os.path.exists(sock):
        time.sleep(0.01)
    server_s = time.time() - t
    runtime_env = {"py_executable": f"{sys.executable} -I CLIENT {sock}"}
else:  # a runtime environment too: Ray's start goes through the same setup_worker.py
    runtime_env = {"env_vars": {"SIDE": "ray"}}

@ray.remote(num_cpus=1)
class Worker:
    def __init__(self):
        import torch, ray.train.torch  # noqa: F401
    def parent(self):
        return os.getppid()

times, parents = [], []
for _ in range(rounds):
    t = time.time()
    actors = [Worker.options(runtime_env=runtime_env).remote() for _ in range(2)]
    parents += ray.get([a.parent.remote() for a in actors])
    times.append(time.time() - t)
    for a in actors:
        ray.kill(a)
    time.sleep(1.0)
forked = server is not None and all(p == server.pid for p in parents)
if server is not None:
    server.kill()
    os.unlink(sock)
print(json.dumps({"times": times, "server_start_s": server_s, "forked": forked}))
'''


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="interleaved drivers per side")
    p.add_argument("--rounds", type=int, default=2, help="actor pairs per driver")
    args = p.parse_args()
    code = (DRIVER.replace("SERVER", str(HERE / "server.py"))
            .replace("CLIENT", str(HERE / "client.py"))
            .replace("PRELOAD", repr(PRELOAD)))
    load = [loadavg()]
    with tempfile.TemporaryDirectory(prefix="bench-fork-server-") as tmp:
        head = start_head(Path(tmp))
        runs: dict[str, list[dict]] = {"ray": [], "fork_server": []}
        try:
            env = {**node_env(), "RAY_ADDRESS": head.address}
            for i in range(args.repeats):
                for side in (("ray", "fork_server") if i % 2 == 0 else ("fork_server", "ray")):
                    out = subprocess.run(
                        [sys.executable, "-c", code, side, f"{tmp}/fork.sock", str(args.rounds)],
                        env=env, capture_output=True, text=True, timeout=300)
                    if out.returncode != 0:
                        raise RuntimeError(f"{side}: {out.stderr[-2000:]}")
                    runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
        finally:
            stop_cluster(head)
    load.append(loadavg())
    pair_s = {side: statistics.median(t for r in rs for t in r["times"])
              for side, rs in runs.items()}
    print(json.dumps({
        "command": "python scripts/bench_fork_server.py " + " ".join(sys.argv[1:]),
        "what": "two 1-CPU actors importing torch and ray.train.torch, request to both ready",
        "pair_ready_s": pair_s,
        "fork_server_vs_ray": round(pair_s["fork_server"] / pair_s["ray"], 3),
        "server_start_s": statistics.median(r["server_start_s"] for r in runs["fork_server"]),
        "every_worker_forked": all(r["forked"] for r in runs["fork_server"]),
        "loadavg": load, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
