"""Runs a batch of `python -m orchestrator` commands (tests/conftest.py: CliBatch) as children
forked from one process that has imported what every command imports first (Hydra, the
orchestrator's config and checks, torch), instead of each a new Python: ~3 CPU-seconds less a
command on this machine. Each child is the command as `python -m orchestrator` runs it (its
`__main__`, its own argument list, its folder first on the path, its own standard streams,
its exit code from os._exit); the batch's folder and environment are this process's.

    python tests/cli_runner.py SPEC.json

SPEC: {"commands": {key: {"argv": [...], "stdout": path, "stderr": path}}}; prints
{key: [exit code, seconds since the batch started]} as JSON once all have ended.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time

from orchestrator.ray_internals.fork_server.server import exit_code


def warm() -> None:
    """What every command imports before its checks (no Ray: its import reads variables
    that __main__ sets first; no thread is started by any of these)."""
    import hydra  # noqa: F401
    import torch  # the trial of the user's parts

    # torch imports its compiler front end with the first optimizer (the trial builds one).
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

    import orchestrator.cli  # noqa: F401
    import orchestrator.config.preflight  # noqa: F401


def child(argv: list[str], stdout: str, stderr: str) -> None:
    try:  # a runner stopped (a test timed out) stops its commands, as a SIGTERM to each would
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    out = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.argv = ["-m", *argv]
    sys.path[0] = os.getcwd()  # `python -m`: the command's folder first
    code = 1
    try:
        code = exit_code(lambda: runpy.run_module("orchestrator", run_name="__main__",
                                                  alter_sys=True))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    warm()
    started, children = time.time(), {}
    for key, command in spec["commands"].items():
        pid = os.fork()
        if pid == 0:
            child(command["argv"], command["stdout"], command["stderr"])
        children[pid] = key
    ended = {}
    while children:
        pid, status = os.wait()
        if pid in children:
            ended[children.pop(pid)] = [os.waitstatus_to_exitcode(status), time.time() - started]
    print(json.dumps(ended), flush=True)


if __name__ == "__main__":
    main()
