"""The service: runs the commands handed to it, one at a time, in its own process, on the Ray
its first command started, and keeps processes ready for the next (see __init__.py)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.ray_internals.cluster import exited_ray_process
from orchestrator.service import served_env
from orchestrator.service.place import (
    ForeignListener,
    Reader,
    code_stamp,
    connect,
    peer_uid,
    send,
    socket_path,
)

log = logging.getLogger("orchestrator")

# Where modules may stay loaded between commands: the installed packages and the standard
# library, and this project's own packages. Anything else a command imported (the user's own
# modules, which may change before the next command) is forgotten after it.
KEPT_ROOTS = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
OUR_PACKAGES = ("orchestrator", "trainers", "hydra_plugins")


@dataclass
class Command:
    conn: socket.socket
    reader: Reader
    request: dict
    fds: list[int] = field(default_factory=list)


class NotServed(Exception):
    """The command could not be set up (its folder, its terminal): nothing of it ran, and the
    service is as it was. The message is the one line its command prints."""


class Service:
    def __init__(self) -> None:
        self.path = socket_path()
        self.stamp = code_stamp()
        self.commands: queue.Queue[Command | None] = queue.Queue()
        self.busy = threading.Event()
        self.preparing: threading.Thread | None = None  # keeping processes ready (keep_ready)
        self.next_command = threading.Event()  # ends the preparing
        self.keep_alive_s = 600.0  # until the first command says
        self.held = None
        self.listener = listen(self.path)
        self.inode = self.path.lstat().st_ino  # the socket's file (fstat of it gives sockfs's)

    def run(self) -> None:
        from orchestrator.driver import interrupts
        from orchestrator.driver.session_start import hold_sessions

        self.held = hold_sessions()
        interrupts.at_once[0] = signal.SIG_IGN  # a Ctrl-C once a run is over: it ends anyway
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # between commands: nothing to interrupt
        threading.Thread(target=self.accept, name="accept", daemon=True).start()
        try:
            while True:
                try:
                    command = self.commands.get(timeout=self.keep_alive_s)
                except queue.Empty:
                    log.info("no command for %.0f s: stopping", self.keep_alive_s)
                    return
                if command is None:
                    return
                try:
                    self.serve(command)
                except Exception:  # noqa: BLE001  (a set-up's failure is answered in serve)
                    # A bug past the set-up: what the command changed may not be undone, so the
                    # service ends rather than run the next command in that state.
                    log.exception("serving a command failed: the service stops")
                    finish(command, {"error": "the service failed while serving this command "
                                              f"and has stopped (its log: "
                                              f"{self.path.with_suffix('.log')})"})
                    return
        finally:
            self.close()

    def accept(self) -> None:
        stopping = None  # why the service ends once its command is done (a stop, new code)
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            if not same_user(conn):  # nothing read, nothing answered
                conn.close()
                continue
            reader = Reader(conn)
            try:
                request = reader.next()
            except (OSError, ValueError):
                request = None

            if request is None:
                answer(conn, reader, {})
                continue
            if request.get("status"):
                answer(conn, reader, self.status())
                continue
            if stopping is not None:  # still answering, so no one waits on the backlog
                answer(conn, reader, {"stopping": os.getpid()} if request.get("stop")
                       else {"declined": f"the service is stopping after its command ({stopping})"})
                continue
            if request.get("stop") or request.get("stamp") != self.stamp:
                stopping = "asked to stop" if request.get("stop") else "the code changed"
                answer(conn, reader, {"stopping": os.getpid()} if request.get("stop") else
                       {"stale": "the orchestrator's code changed since the service started"})
                self.commands.put(None)
                if not self.busy.is_set():
                    return
                continue
            if self.busy.is_set():
                answer(conn, reader, {"declined": "the service is running another command"})
                continue
            gone = exited_ray_process()
            if gone:  # a Ray whose core process died takes the next command down with it
                answer(conn, reader, {"declined": f"the service's Ray stopped (its {gone} exited), so the "
                                    "service stops too"})
                self.commands.put(None)
                return
            self.busy.set()
            self.commands.put(Command(conn, reader, request, reader.fds))

    def status(self) -> dict:
        from orchestrator.ray_internals.ready_processes import idle_processes

        ready = idle_processes() if self.held and self.held.session else []
        return {"pid": os.getpid(), "busy": self.busy.is_set(), "job": job_id(),
                "ray": bool(self.held and self.held.session) and not exited_ray_process(),
                "ready_processes": len(ready),
                "preparing": bool(self.preparing and self.preparing.is_alive()),
                "keep_alive_s": self.keep_alive_s}

    def serve(self, command: Command) -> None:
        request = command.request
        self.keep_alive_s = float(request["keep_alive_s"])
        try:
            send(command.conn, {"started": os.getpid()})
        except OSError:  # the command's process is gone: nothing to run
            finish(command, {})
            self.busy.clear()
            return
        self.held.folder = request["cwd"]
        self.stop_preparing()
        differ = served_env.credentials_differ(request["env"])
        if differ:  # its workers would run with the first command's credentials
            finish(command, {"declined": "the service's Ray was started with other "
                                         f"credentials ({', '.join(differ)})"})
            self.busy.clear()
            return
        idle = idle_now()
        actors: list[dict] = []
        try:
            with served_state(command.fds, request):
                reply, actors = self.run_served(command, idle)
        except NotServed as exc:
            log.warning("a command was not run: %s", exc)
            reply = {"error": str(exc)}
        finish(command, reply)
        self.busy.clear()
        if actors:  # a command that started no actor (bad input) leaves the ready ones
            self.preparing = threading.Thread(target=self.keep_ready, args=(actors,),
                                              name="keep-ready", daemon=True)
            self.preparing.start()

    def stop_preparing(self) -> None:
        if self.preparing is not None:
            self.next_command.set()
            self.preparing.join()  # what it ends and starts must not be this command's
            self.next_command.clear()

    def run_served(self, command: Command, idle: set[int]) -> tuple[dict, list[dict]]:
        """Run the command, in its terminal, environment and folder: the reply to send, and
        the actors it started."""
        from orchestrator.driver.session_start import OtherSettings

        request = command.request
        relay = Relay(command.reader)
        started = time.time()
        ray_was_up = ray_up()
        try:
            reply = {"exit": run_command(request)}
        except OtherSettings as exc:
            reply = {"declined": f"the service's Ray was started with other settings: {exc}"}
        finally:
            relay.stop()
            if not ray_was_up and ray_up():  # this command started the Ray its processes share
                served_env.ray_started_with = dict(request["env"])
        actors = self.actors_since(started)
        if actors:
            self.report_ready(actors, idle)
        return reply, actors

    def actors_since(self, started: float) -> list[dict]:
        from orchestrator.ray_internals.ready_processes import actors_started_since

        if self.held.session is None:
            return []
        try:
            return actors_started_since(started)
        except Exception as exc:  # noqa: BLE001  (private tables: a speed-up, not the run)
            log.warning("the actor table is unavailable: %s", exc)
            return []

    def report_ready(self, actors: list[dict], idle_before: set[int]) -> None:
        """Say, in the command's output, how many of its actors found a process ready."""
        ready = sum(a["pid"] in idle_before for a in actors)
        cold = sorted(a["class"] for a in actors if a["pid"] not in idle_before)
        if cold:
            log.debug("actors that started a process: %s", ", ".join(cold))
        log.info("kept alive: %d of the run's %d actors started in processes kept ready; the "
                 "service (pid %d) keeps this Ray %.0f s after its last command "
                 "(python -m orchestrator.service stop)", ready, len(actors), os.getpid(),
                 self.keep_alive_s)

    def keep_ready(self, actors: list[dict]) -> None:
        from orchestrator.ray_internals.ready_processes import end_run_actors, keep_ready_like

        try:
            killed = end_run_actors(actors)
            if killed:
                log.info("ended the run's actors left running: %s", ", ".join(killed))
            problem = keep_ready_like(actors, self.keep_alive_s, self.next_command)
        except Exception as exc:  # noqa: BLE001
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            log.warning("no processes kept ready for the next command: %s", problem)

    def close(self) -> None:
        """Stop listening first (a command sent now starts a new service), then end what it
        was keeping ready (not to ask a Ray that is going), then Ray."""
        try:
            if self.path.lstat().st_ino == self.inode:
                self.path.unlink()  # ours, not a newer service's
        except OSError:
            pass
        self.listener.close()
        if self.preparing is not None:
            self.next_command.set()
            self.preparing.join(timeout=15)
        if self.held is not None and self.held.session is not None:
            self.held.session.close()


def listen(path: Path) -> socket.socket:
    """Bind the service's socket; a file left by a service that died (or a link, never
    followed) is replaced, a live service's is not (SystemExit: that one serves)."""
    try:
        probe = connect(path)
    except ForeignListener as exc:
        raise SystemExit(str(exc)) from None
    if probe is not None:
        probe.close()
        raise SystemExit(f"a service already listens at {path}")
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Made 0600 as it is bound (a chmod after would follow a link put in its place).
    mask = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(mask)
    listener.listen(8)
    return listener


def same_user(conn: socket.socket) -> bool:
    """The client runs as this service's user (the folder's mode is the first lock, this the
    second): a request is a command to run as this user, and an answer holds its details."""
    try:
        uid = peer_uid(conn)
    except OSError:  # gone already
        return False
    if uid != os.getuid():
        log.warning("refused a connection from uid %d: the service serves only its own user",
                    uid)
    return uid == os.getuid()


def finish(command: Command, reply: dict) -> None:
    """Send the command its last reply (none if empty); close what it handed over."""
    close_all(command.fds)
    if reply:
        try:
            send(command.conn, reply)
        except OSError:
            pass  # the command's process is gone
    command.conn.close()


def close_all(fds: list[int]) -> None:
    """Close each and empty the list: none is closed twice (its number may be another's by
    then)."""
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


def idle_now() -> set[int]:
    """The Ray processes kept ready before a command, to count which of its actors took one."""
    from orchestrator.ray_internals.ready_processes import idle_processes

    return set(idle_processes()) if ray_up() else set()


@contextlib.contextmanager
def served_state(fds: list[int], request: dict):
    """The command's terminal, environment, folder, umask and imports for the body; the
    service's own back afterwards, however it ends. Each step undoes itself, so one that fails
    (NotServed) leaves the service as it was."""
    with contextlib.ExitStack() as steps:
        try:
            steps.enter_context(terminal(fds))
            steps.enter_context(environment(request["env"]))
            steps.enter_context(folder(request["cwd"]))
            steps.enter_context(umask(request["umask"]))
            steps.enter_context(imports(request["cwd"], request["env"]))
        except NotServed:
            raise
        except Exception as exc:
            raise NotServed(f"the service could not set the command up ({type(exc).__name__}: "
                            f"{exc}); run it without cluster.keep_alive") from exc
        yield


@contextlib.contextmanager
def terminal(fds: list[int]):
    """The command's standard streams as 0, 1, 2 (the descriptors handed over are closed)."""
    saved: list[int] = []
    try:
        flush_streams()
        for target in (0, 1, 2):
            saved.append(os.dup(target))
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        close_all(fds)
        yield
    finally:
        flush_streams()
        reset_logging()  # the command's handlers (its terminal, its run folder's log) go with it
        for target, fd in enumerate(saved):
            os.dup2(fd, target)
        close_all(saved)
        close_all(fds)


@contextlib.contextmanager
def environment(env: dict[str, str]):
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def folder(path: str):
    saved = os.getcwd()  # the service's own: "/" (main)
    try:
        try:
            os.chdir(path)
        except OSError as exc:
            raise NotServed(f"the service cannot enter the command's folder {path} "
                            f"({exc.strerror}); run it from a folder that exists and that you "
                            "can enter") from None
        yield
    finally:
        os.chdir(saved)


@contextlib.contextmanager
def umask(mask: int):
    """The command's umask, as its client read it: the files it makes have the modes they would
    have on its own."""
    if type(mask) is not int or not 0 <= mask <= 0o777:
        raise NotServed(f"the command's umask {mask!r} is not a umask")
    saved = os.umask(mask)
    try:
        yield
    finally:
        os.umask(saved)


@contextlib.contextmanager
def imports(cwd: str, env: dict[str, str]):
    """As `python -m` gives a command: its folder first on the path, then its PYTHONPATH; the
    modules it imported from elsewhere (its own) are forgotten afterwards."""
    argv, path, modules = sys.argv[:], sys.path[:], set(sys.modules)
    try:
        theirs = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [cwd, *theirs, *[p for p in path[1:] if p not in theirs]]
        importlib.invalidate_caches()
        yield
    finally:
        sys.argv[:] = argv
        sys.path[:] = path
        forget_modules(set(sys.modules) - modules)


def flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            pass  # the command's terminal is gone


def job_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_job_id() if ray.is_initialized() else None


def ray_up() -> bool:
    import ray

    return ray.is_initialized()


def run_command(request: dict) -> int:
    from orchestrator.cli import run_command as run
    from orchestrator.driver.session_start import OtherSettings

    try:
        return run(request["argv"], request["started_at"])
    except OtherSettings:
        raise
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 1
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except BaseException:  # noqa: BLE001  (the command's failure, never the service's)
        say(traceback.format_exc())
        return 1


def say(text: str) -> None:
    """To the command's terminal, which may be gone (its process killed)."""
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        pass


class Relay:
    """The command's Ctrl-C (or its process gone) interrupts the run, as it would a plain
    command: SIGINT to this process, while the command runs."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader
        self.lock = threading.Lock()
        self.running = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a plain command's
        threading.Thread(target=self.watch, name="relay", daemon=True).start()

    def watch(self) -> None:
        while True:
            try:
                message = self.reader.next()
            except (OSError, ValueError):
                message = None
            if message is None or "signal" in message:
                with self.lock:
                    if not self.running:
                        return
                    os.kill(os.getpid(), signal.SIGINT)
            if message is None:
                return

    def stop(self) -> None:
        """No SIGINT from here on; one sent just before is taken here, not by the service."""
        while True:
            try:
                with self.lock:
                    self.running = False
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                return
            except KeyboardInterrupt:
                continue


def forget_modules(names: set[str]) -> None:
    for name in names:
        module = sys.modules.get(name)
        where = getattr(module, "__file__", None) or ""
        if name.split(".")[0] in OUR_PACKAGES or where.startswith(KEPT_ROOTS):
            continue
        sys.modules.pop(name, None)


def reset_logging() -> None:
    """The command's handlers (its terminal, its run folder's log file) go with it."""
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        if isinstance(logger, logging.Logger):
            for handler in logger.handlers[:]:
                logger.removeHandler(handler)
                handler.close()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")


def main() -> None:
    from orchestrator.redaction import hide_secrets_in_logs

    hide_secrets_in_logs()
    sys.stdout.reconfigure(line_buffering=True)
    reset_logging()
    service = Service()
    os.chdir("/")  # its own folder between commands: never one a command's user may remove
    log.info("service %d listening at %s", os.getpid(), service.path)
    import orchestrator.cli  # noqa: F401  (Hydra, the config schema: ready for the first command)
    service.run()


def answer(conn, reader: Reader, message: dict) -> None:
    """Every reply but a command's: the descriptors sent with it are closed here (a declined
    command's stdout held open kept `| tee` waiting until the service ended)."""
    close_all(reader.fds)
    if message:
        try:
            send(conn, message)
        except OSError:
            pass  # the asking process is gone
    conn.close()
