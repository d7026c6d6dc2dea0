"""The raylet's `py_executable` while a fork server serves the job (fork_server/__init__.py),
run as `python -I client.py SOCKET default_worker.py ...`: hands this worker process's
arguments, environment, folder and standard streams to the server at SOCKET, waits for the
forked worker and exits with its code; signals it gets go to the worker. Without a server
there (not up yet, or ended) it becomes the worker itself, as Ray would have started it.
Standard library only, and isolated (-I): it starts in milliseconds."""

import array
import json
import os
import signal
import socket
import sys

path = sys.argv.pop(1)
try:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request = json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()})
    conn.sendmsg([request.encode() + b"\n"],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
    replies = conn.makefile("r")
    child = int(replies.readline())
except (OSError, ValueError):  # no server (or it went): an ordinary worker process
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])


def forward(signum, _frame):
    try:
        os.kill(child, signum)
    except ProcessLookupError:
        pass


for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, forward)
line = replies.readline()
sys.exit(int(line) if line.strip() else 1)
