"""The raylet's `py_executable` for scripts/fork_server/server.py, `python -I client.py SOCKET`:
hands this worker process's arguments, environment, folder and standard streams to the server
at SOCKET, waits for the forked worker and exits with its code; without a server there it runs
the worker itself."""

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
except OSError:  # no server on this node (yet): an ordinary worker process
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
request = json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()})
conn.sendmsg([request.encode() + b"\n"],
             [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
replies = conn.makefile("r")
child = int(replies.readline())


def forward(signum, _frame):
    try:
        os.kill(child, signum)
    except ProcessLookupError:
        pass


for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, forward)
line = replies.readline()
sys.exit(int(line) if line.strip() else 1)
