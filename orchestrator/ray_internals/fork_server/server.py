"""The fork server (fork_server/__init__.py): imports Ray and what the job's processes import,
then forks a child for each worker process the raylet starts through client.py.

    python -P server.py SOCKET [MODULE[:FUNCTION] ...]

Started with the job's RAY_JOB_ID and the raylet's RAY_RAYLET_PID in its environment (Ray's
C++ config reads both once, when `import ray` loads it). A child takes its client's argument
list, environment, folder and standard streams, gets a session of its own (Ray kills an exited
worker's process group: the server's otherwise), sizes torch's thread pool as its own
environment says (torch read the server's at import), reseeds numpy's global generator (Python's
reseeds itself at a fork), and runs Ray's default_worker.py, then the exit handlers a normal
exit would (Ray's worker shuts down in one). The server forks only from its main thread,
between requests; the threads it keeps only wait. It serves only its own user, and ends with
the process that started it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import array
import atexit
import contextlib
import ctypes
import json
import os
import runpy
import signal
import socket
import struct
import sys
import threading

from orchestrator.worker.warm import import_ahead, threads_for_cpus

PARENT = "ORCHESTRATOR_FORK_PARENT"  # fork_server/__init__.py's
OPEN: set[socket.socket] = set()  # the clients served, whose workers live: not a child's


def end_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.environ.get(PARENT) and os.getppid() != int(os.environ[PARENT]):
        sys.exit(0)  # the driver ended before the line above: nothing to serve


def same_user(conn: socket.socket) -> bool:
    """The client runs as this server's user (its socket's folder admits no other; this is
    the second lock)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1] == os.getuid()


@contextlib.contextmanager
def actor_class_ids_from_urandom():
    """Ray Data's and Ray Train's modules declare actor classes as they import, and each
    declaration draws an ActorClassID from Ray's C++ generator, which seeds it (and its pool):
    every child would then draw its siblings' IDs (ids_differ_in_children). Drawn from
    os.urandom while the modules import, nothing is seeded; each child seeds its own at its
    first draw, as a new process does."""
    import ray.actor

    real = ray.actor.ActorClassID

    class FromUrandom:
        @staticmethod
        def from_random():
            return real(os.urandom(real.size()))

    ray.actor.ActorClassID = FromUrandom
    try:
        yield
    finally:
        ray.actor.ActorClassID = real


def ids_differ_in_children() -> bool:
    """Two children forked now make different random Ray IDs. Ray's C++ side draws them from a
    generator per thread, seeded at its first draw from a pool the process shares: had an
    import drawn one here (Ray Data's would, but for actor_class_ids_from_urandom), every child
    would make the same worker, task and object IDs as its siblings, and a process that takes
    calls from two of them (Ray Train's controller) would mix them up or abort."""
    seen = []
    for _ in range(2):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            import ray

            os.write(write, ray.ObjectRef.from_random().hex().encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            seen.append(pipe.read())
        os.waitpid(pid, 0)
    return len(set(seen)) == 2 and all(seen)


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


def threads_as_asked() -> None:
    """torch sized its thread pool from the server's environment: size it from the child's, as
    the worker's own import would have (OMP_NUM_THREADS, else its CPUs, as warm.py sets)."""
    torch = sys.modules.get("torch")
    wanted = threads_for_cpus()
    if torch is not None and wanted and wanted.isdigit():
        torch.set_num_threads(int(wanted))


def exit_code(run) -> int:
    """What the interpreter would exit with once ``run()`` ends: its SystemExit's code, or 1
    with the traceback printed for any other exception."""
    try:
        run()
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        return 1


def run_child(request: dict, fds: list[int]) -> None:
    for conn in OPEN:  # other workers' clients: their end of file must come when the server's does
        conn.close()
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    run = as_main(request["argv"])
    threads_as_asked()
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # its global generator, seeded once here: fresh, as a new process's
        numpy.random.seed()
    code = 1
    try:
        code = exit_code(run)
    finally:
        # What the interpreter's exit would run: its other threads joined (a checkpoint's
        # upload), then the exit handlers (Ray's worker shuts down in one).
        with contextlib.suppress(Exception):
            threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def as_main(argv: list[str]):
    """What `python [flags] script.py args` (Ray's default_worker.py) or `python [flags] -m
    module args` would run, with sys.argv and sys.path as that command would have them."""
    if "-m" in argv:  # the module's folder search starts with the command's folder, as -m's
        at = argv.index("-m")
        sys.argv = ["-m", *argv[at + 2:]]
        given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:1] = [os.getcwd(), *(p for p in given if p not in sys.path)]
        return lambda: runpy.run_module(argv[at + 1], run_name="__main__", alter_sys=True)
    # The interpreter's flags before the script (python -u default_worker.py ...), if any.
    script = next((i for i, arg in enumerate(argv) if arg.endswith(".py")), 0)
    sys.argv = argv[script:]
    return lambda: runpy.run_path(sys.argv[0], run_name="__main__")


def same_node_and_job(env: dict) -> bool:
    """The client's process is one this server's raylet started for its job: a worker of
    another node on the same machine (a test cluster's `ray start` nodes, a network
    namespace's host) must not run in this node's process and watch this raylet."""
    return all(env.get(key, os.environ[key]) == os.environ[key]
               for key in ("RAY_RAYLET_PID", "RAY_JOB_ID"))


def serve(server: socket.socket, conn: socket.socket, admit=same_node_and_job) -> None:
    """One client's process, forked if ``admit(its environment)``; else the client becomes it."""
    if not same_user(conn):
        conn.close()
        return
    request, fds = receive(conn)
    if not admit(request["env"]):
        for fd in fds:
            os.close(fd)
        conn.close()  # no pid: the client becomes the worker itself
        return
    pid = os.fork()
    if pid == 0:
        server.close()
        conn.close()
        run_child(request, fds)
    OPEN.add(conn)
    for fd in fds:
        os.close(fd)
    with contextlib.suppress(OSError):  # a client gone already: client_gone ends its worker
        conn.sendall(f"{pid}\n".encode())

    def client_gone() -> None:  # the raylet killed the client: its worker goes too
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
        OPEN.discard(conn)
        conn.close()

    threading.Thread(target=client_gone, daemon=True).start()
    threading.Thread(target=reap, daemon=True).start()


def main() -> None:
    end_with_parent()
    path = sys.argv[1]
    with actor_class_ids_from_urandom():
        import_ahead(sys.argv[2:])

    if not ids_differ_in_children():
        print("fork server: not serving: an import seeded Ray's ID generator (children would "
              "share IDs)", file=sys.stderr, flush=True)
        return  # no socket: every process starts as Ray starts it
    listen_and_serve(path)


def listen_and_serve(path: str, admit=same_node_and_job) -> None:
    """Serve the clients of the socket at ``path`` until the process ends."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the socket appears only once the server is ready
    server.listen(64)
    while True:
        conn, _ = server.accept()
        try:
            serve(server, conn, admit)
        except (EOFError, OSError, ValueError):
            conn.close()


if __name__ == "__main__":
    main()
