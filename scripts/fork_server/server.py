"""A fork server for Ray worker processes, measured by scripts/bench_fork_server.py (issue 30:
a lead for a warm command <= 1.3x torchrun; tried in one and no faster on 2 cores, see
docs/benchmarks.md). Not used by the orchestrator.

Started once per Ray job on a node, with the job's RAY_JOB_ID and the raylet's RAY_RAYLET_PID
in its environment (Ray's C++ config reads both once, when `import ray` loads it, so one server
cannot serve two jobs), it imports Ray and torch, then forks a child for each worker process
the raylet starts: the raylet runs `client.py` as the runtime environment's `py_executable`,
the client hands over its argument list, environment, folder and standard streams, and the
child runs Ray's default_worker.py in them. Each child gets its own session: Ray kills an
exited worker's process group, which would otherwise be the server's and its caller's.

    python scripts/fork_server/server.py SOCKET [MODULE ...]
"""

from __future__ import annotations

import array
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time

started = time.time()
import ray  # noqa: E402

for name in sys.argv[2:]:
    __import__(name)
DEFAULT_WORKER = os.path.join(os.path.dirname(ray.__file__), "_private", "workers",
                              "default_worker.py")


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds = b"", array.array("i")
    while not data.endswith(b"\n"):
        msg, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_LEN(3 * fds.itemsize))
        if not msg:
            raise EOFError
        data += msg
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return json.loads(data), list(fds)


def run_child(request: dict, fds: list[int]) -> None:
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = request["argv"]
    try:
        runpy.run_path(DEFAULT_WORKER, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    os._exit(code)


def serve(server: socket.socket, conn: socket.socket) -> None:
    request, fds = receive(conn)
    pid = os.fork()
    if pid == 0:  # forked from the main thread: the other threads only wait
        server.close()
        conn.close()
        run_child(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())

    def client_gone() -> None:  # the client killed: its worker goes too
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def reap() -> None:
        _, status = os.waitpid(pid, 0)
        try:
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
        except OSError:
            pass
        conn.close()

    threading.Thread(target=client_gone, daemon=True).start()
    threading.Thread(target=reap, daemon=True).start()


def main() -> None:
    path = sys.argv[1]
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the socket appears only once it is ready
    server.listen(64)
    print(f"ready in {time.time() - started:.2f} s", flush=True)
    while True:
        conn, _ = server.accept()
        try:
            serve(server, conn)
        except (EOFError, OSError):
            conn.close()


if __name__ == "__main__":
    main()
