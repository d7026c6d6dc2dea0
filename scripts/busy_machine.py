"""A command run on a busy, shared machine: another Ray beside it (its dashboard on 8265 and
its agent on 52365, Ray's defaults, as another user's would hold them) and busy loops on every
core, then everything this script started stopped by pid.

    python scripts/busy_machine.py -- make test
    python scripts/busy_machine.py --loops 2 -- python -m orchestrator

Prints JSON: the command's exit code and wall time, the load average it ran at, and whether
the other Ray held Ray's default ports.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.local_cluster import RAY, came_up, free_port, node_env, stop_head  # noqa: E402

DEFAULT_PORTS = (8265, 52365)  # Ray's dashboard and dashboard agent


def held(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def other_ray(folder: Path) -> subprocess.Popen | None:
    """Another Ray on the machine, on Ray's default dashboard and agent ports (None where
    `ray start` did not come up)."""
    log_path = folder / "other-ray.log"
    proc = subprocess.Popen(
        [RAY, "start", "--head", "--block", f"--port={free_port()}", "--num-cpus=1",
         "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", "--disable-usage-stats",
         f"--temp-dir={folder / 'ray'}"],
        stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=node_env(),
        start_new_session=True)
    if came_up(proc, log_path, 300):
        return proc
    stop_head(proc)
    return None


def as_ctrl_c(signum, frame):
    """A kill or a timeout stops the command and everything started here, as Ctrl-C does."""
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", type=int, default=os.cpu_count() or 2,
                        help="busy loops beside the command (default: one per core)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("the command to run goes after --")
    signal.signal(signal.SIGTERM, as_ctrl_c)
    folder = Path(tempfile.mkdtemp(prefix="busy-machine-"))
    ray = other_ray(folder)
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(args.loops)]
    started = time.monotonic()
    code = 130
    try:
        with subprocess.Popen(command, cwd=os.getcwd(), start_new_session=True) as proc:
            try:
                code = proc.wait()
            except KeyboardInterrupt:
                os.killpg(proc.pid, signal.SIGTERM)  # the command's whole process group
                proc.wait()
    finally:
        wall = time.monotonic() - started
        load = os.getloadavg()
        ports_held = {port: held(port) for port in DEFAULT_PORTS}
        for loop in loops:
            loop.send_signal(signal.SIGKILL)
            loop.wait()
        if ray is not None:
            stop_head(ray)
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps({"command": command, "exit_code": code, "wall_s": round(wall, 1),
                      "busy_loops": args.loops, "other_ray": ray is not None,
                      "default_ports_held_by_the_other_ray": ports_held,
                      "load_average_at_end": [round(x, 1) for x in load]}))
    return code


if __name__ == "__main__":
    sys.exit(main())
