"""The tests' `python -m orchestrator` commands (tests/conftest.py: start_run, run_cli and the
sweep helper), each forked from this one process that imported what every command imports first
(Hydra, torch and its first optimizer, the orchestrator's config and checks: ~3.5 CPU-seconds a
command), through the product's fork server protocol (orchestrator/ray_internals/fork_server/):
the test's process is the client (`python -I client.py SOCKET -m orchestrator ...`), which
hands its arguments, environment, folder and standard streams over, forwards the signals it
gets (a test's Ctrl-C, SIGTERM) to the command and exits with the command's code; killed, it
takes the command with it. Without the server (not started, or gone) the client runs the
command itself, as `python -m orchestrator` would. Ray is not imported here: a command sets
Ray's variables before its first import of it.

    python tests/driver_server.py SOCKET
"""

from __future__ import annotations

import sys

from orchestrator.ray_internals.fork_server.server import end_with_parent, listen_and_serve


def warm() -> None:
    import hydra  # noqa: F401
    import torch  # the trial of the user's parts

    # torch imports its compiler front end with the first optimizer (the trial builds one).
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

    import orchestrator.cli  # noqa: F401
    import orchestrator.config.preflight  # noqa: F401


def main() -> None:
    end_with_parent()  # pytest's process (ORCHESTRATOR_FORK_PARENT)
    warm()
    listen_and_serve(sys.argv[1], admit=lambda env: True)


if __name__ == "__main__":
    main()
