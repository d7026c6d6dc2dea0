"""Start an embedded Ray, or join a running cluster after checking that it answers."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path

import ray

from orchestrator.config.schema import ClusterConfig
from orchestrator.driver.interrupts import DeferredInterrupt
from orchestrator.driver.ports import PortHold
from orchestrator.driver.processes import (
    adopt_orphans,
    descendants,
    kill_descendants,
    release_orphans,
    socket_folders,
    stop_leftovers,
)
from orchestrator.errors import ConfigError, MachineError
from orchestrator.observe.logs import quiet_ray_loggers, ray_init_kwargs
from orchestrator.private_dir import remove_dead_dirs
from orchestrator.ray_internals.cluster import (
    CURRENT_CLUSTER_FILE,
    no_ray_shutdown_at_exit,
    ray_shutdown_at_exit,
    stop_autoscaler_monitor,
    token_auth_enabled,
    token_location,
    use_token_auth_if_available,
)
from orchestrator.ray_internals.entrypoint import redacted_entrypoint
from orchestrator.ray_internals.head_start import embedded_head, stopping
from orchestrator.ray_internals.knobs import EMBEDDED_SYSTEM_CONFIG
from orchestrator.ray_internals.process_starts import close_starts

log = logging.getLogger("orchestrator")

PROBE_TIMEOUT_S = 5.0
LEFTOVER_GRACE_S = 3.0  # an embedded cluster's processes still running after ray.shutdown()


def user_pythonpath() -> dict[str, str]:
    """The driver's PYTHONPATH for Ray's processes, where the user set one (a joined cluster's
    raylet started with its own environment)."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": path} if path else {}


def resolve_address(address: str) -> str:
    """'auto' -> RAY_ADDRESS or the cluster `ray start` recorded on this machine."""
    if address != "auto":
        return address
    env = os.environ.get("RAY_ADDRESS")
    if env and env != "auto":
        return env
    if CURRENT_CLUSTER_FILE.exists():
        recorded = recorded_cluster(CURRENT_CLUSTER_FILE)
        if recorded:
            return recorded
    raise ConfigError(
        "cluster.address='auto' found no running Ray cluster on this machine: "
        "start one with `ray start --head`, set RAY_ADDRESS, or give host:port"
    )


def recorded_cluster(path: Path) -> str:
    """The address `ray start --head` recorded, if this user's own: the file lies in a folder
    every user can write to, and the driver sends its Ray token to the address it names."""
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & stat.S_IWOTH:
        whose = "another user's" if info.st_uid != os.getuid() else "writable by other users"
        raise ConfigError(
            f"cluster.address='auto': {path} is {whose} (uid {info.st_uid}, mode "
            f"{stat.S_IMODE(info.st_mode):o}): not followed, since the driver would send its Ray "
            "token there; set RAY_ADDRESS or give cluster.address=host:port")
    return path.read_text().strip()


def probe(address: str) -> None:
    """Fail fast (seconds, not minutes) when nothing listens at host:port."""
    target = address.split("://", 1)[-1]
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"cluster.address={address!r} is not allowed: 'auto' or host:port")
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(
            f"cluster.address={address!r}: nothing answers at {host}:{port} ({reason}); "
            "is the Ray head running (`ray start --head`)?"
        ) from exc


def start_failure(exc: Exception, joined: bool, waited_s: float) -> ConfigError:
    """Ray's start failed: one line. A cluster joined is the input's (its address, its token:
    exit 2); an embedded Ray that did not start is the machine's (exit 1), most often one too
    busy to start Ray's processes in time, where the same command later works."""
    text = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")[:200]
    if joined:
        return ConfigError(f"cluster: Ray did not start ({type(exc).__name__}: {text})")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return MachineError(
        f"cluster: Ray did not start on this machine in {waited_s:.0f} s ({type(exc).__name__}: "
        f"{text}); the machine may be too busy (load average {load:.1f} on {os.cpu_count()} "
        "cores): run the command again when it is less busy, or start Ray yourself "
        "(`ray start --head`) and join it with cluster.address=auto")


class RaySession:
    """Context manager around ray.init / ray.shutdown."""

    dashboard_of_this_process: str | None = None  # for a session that reuses the open one

    def __init__(self, cluster: ClusterConfig, env_vars: dict[str, str] | None = None,
                 verbose: bool = False, keep_open: bool = False, py_executable: str | None = None,
                 defer_dashboard: bool = False, worker_forks: tuple[str, ...] = ()):
        self.cluster = cluster
        # An embedded head's dashboard starts once the run's workers have (head_start.py).
        self.defer_dashboard = defer_dashboard
        self.env_vars = env_vars or {}
        self.verbose = verbose  # log.ray_verbose: Ray's own output in the terminal
        self.dashboard_url: str | None = None
        self.joined = cluster.address is not None
        self.reused = False
        self.keep_open = keep_open  # a service's: stays open after its first command
        # What the raylet runs the job's worker processes with (a sweep's fork server's client,
        # orchestrator/ray_internals/fork_server/), else Ray's own Python.
        self.py_executable = py_executable
        # A run's training workers fork from a server that imported these, once Ray is up
        # (orchestrator/ray_internals/fork_server/); their actors' py_executable then.
        self.worker_forks = worker_forks
        self.worker_py_executable: str | None = None
        self._fork_server = None
        self._fork_dir: str | None = None
        self.interrupted = False  # a Ctrl-C came while Ray was shutting down
        self._started: threading.Event | None = None  # set when the background start ends
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._start_error: BaseException | None = None
        self._dashboard_hold: PortHold | None = None

    def start_in_background(self) -> None:
        """ray.init in a thread: what the command checks meanwhile (the user's parts: torch's
        import and a tiny step, ~2 s) overlaps Ray's start (~4 s, mostly waiting for its
        processes). ``with`` then waits for it. The thread lives until the session ends: Ray
        asks the kernel to kill the processes it starts when the thread that started them
        ends (PR_SET_PDEATHSIG follows the thread, not the process)."""
        started = self._started = threading.Event()

        def start() -> None:
            try:
                self._open()
            except BaseException as exc:  # noqa: BLE001  (raised by __enter__ in the main thread)
                self._start_error = exc
            started.set()
            self._closed.wait()

        self._thread = threading.Thread(target=start, name="ray-start", daemon=True)
        self._thread.start()

    def abandon(self) -> None:
        """The command ends before it used the session it started in the background (its input
        was bad). An embedded cluster's processes are killed at once, started or still
        starting: nothing ran on them, and waiting for Ray's start and shutdown would hold the
        command's exit ~5 s after its error line. A joined cluster's connection is closed."""
        if self._started is None:
            return
        if self.joined:
            self._started.wait()
            if self._start_error is None:
                self.__exit__(None, None, None)
        else:
            stopping()
            self.release_dashboard_port()
            close_starts(self._thread)  # the start thread's next process would outlive the kill
            kill_descendants()
            self.stop_fork_server()
            no_ray_shutdown_at_exit()  # it would wait on the killed GCS (cluster.py)
        self._closed.set()

    def __enter__(self) -> RaySession:
        if self._started is not None:
            try:
                self._started.wait()
            except (KeyboardInterrupt, RuntimeError):  # Ctrl-C while Ray starts (inside the
                self.abandon()  # wait's lock it surfaces as "release unlocked lock")
                raise KeyboardInterrupt from None
            if self._start_error is not None:
                self._closed.set()
                raise self._start_error
            return self
        return self._open()

    def _open(self) -> RaySession:
        c = self.cluster
        if ray.is_initialized():  # a sweep's trial, a service's command: the open session serves it
            self.reused = True
            self.dashboard_url = RaySession.dashboard_of_this_process
            return self
        quiet_ray_loggers(self.verbose)
        redacted_entrypoint()  # the command line the dashboard shows with the job
        ray_shutdown_at_exit()  # where a session abandoned before in this process left it out
        runtime_env = {"env_vars": self.env_vars}
        if self.py_executable:
            runtime_env["py_executable"] = self.py_executable
        quiet = {**ray_init_kwargs(self.verbose), "runtime_env": runtime_env}
        if self.joined:
            address = resolve_address(c.address)
            probe(address)
            use_token_auth_if_available()
            # Ray Train's PlacementGroupCleaner asks the state API whether our controller is
            # alive without an address: it resolves the cluster `ray start` last recorded on
            # the machine (/tmp/ray/ray_current_cluster), and when that is another cluster it
            # finds no controller and removes our workers' placement group (a restart with no
            # error). RAY_ADDRESS in every process of the job pins it to this cluster.
            quiet["runtime_env"]["env_vars"] = {**self.env_vars, "RAY_ADDRESS": address}
            context = self.start(address=address, **quiet)
        else:
            adopt_orphans()  # what Ray starts stays ours to stop, whatever dies first
            # A free port, held until the dashboard starts (driver/ports.py): two commands
            # side by side both get one.
            hold = self._dashboard_hold = PortHold(c.dashboard_port) if c.dashboard else None
            before = set(descendants(os.getpid()))
            # The workers' output is streamed only where it is shown (a service serves only
            # commands of its own log.ray_verbose); the autoscaler's monitor only for a
            # service's head, which users may inspect with `ray status` (head_start.py).
            try:
                with embedded_head(log_monitor=self.verbose, monitor=self.keep_open,
                                   defer_dashboard=self.defer_dashboard, dashboard_port_hold=hold):
                    context = self.start(
                        address="local",  # a new instance, even if a stale `ray start` left its address
                        num_cpus=c.num_cpus or os.cpu_count(),
                        include_dashboard=c.dashboard,
                        dashboard_host="127.0.0.1",  # never beyond this machine by default
                        dashboard_port=hold.port if hold else None,
                        _system_config=EMBEDDED_SYSTEM_CONFIG,
                        **quiet,
                    )
            except BaseException:
                stopping()  # a dashboard still starting fails with this Ray: not news
                if hold:
                    hold.release()
                # What the failed start left running (its GCS, dashboard, agents: Ray stops
                # none of them) ends here, with nothing of this process's own before it.
                kill_descendants(spare=before)
                adopt_orphans(False)  # no session to close: this process adopts no more
                raise
        return self._opened(context)

    def _opened(self, context) -> RaySession:
        """What the session keeps of the Ray it opened: its dashboard's address, and the
        server the run's workers fork from."""
        url = getattr(context, "dashboard_url", None)
        if url:
            self.dashboard_url = url if "://" in url else f"http://{url}"
            RaySession.dashboard_of_this_process = self.dashboard_url
        if self.worker_forks:
            self.start_fork_server()
        return self

    def start_fork_server(self) -> None:
        """The server the run's training workers fork from, where every node of the cluster is
        on this machine (a speed-up only: without it they start as Ray starts them). Its
        socket is in a folder only this user can enter (the clients send it their
        environment)."""
        from orchestrator.ray_internals import fork_server

        try:
            if not fork_server.every_node_here():
                return
        except Exception as exc:  # noqa: BLE001  (a speed-up only)
            log.debug("no fork server: %s", exc)
            return
        self._fork_dir = tempfile.mkdtemp(prefix="orchestrator-fork-")
        path = os.path.join(self._fork_dir, "server.sock")
        self._fork_server = fork_server.start_server(path, self.worker_forks, self.env_vars)
        if self._fork_server is not None:
            self.worker_py_executable = fork_server.client_executable(path)

    def stop_fork_server(self) -> None:
        if self._fork_server is not None:
            self._fork_server.kill()
            self._fork_server.wait()
            self._fork_server = None
        if self._fork_dir is not None:
            shutil.rmtree(self._fork_dir, ignore_errors=True)
            self._fork_dir = None

    def start(self, **kwargs):
        """ray.init, whose own failures are tracebacks of many lines: one line instead
        (start_failure). (The dashboard's are not among them: ray.init does not wait for it,
        and a dashboard that fails is a warning, orchestrator/ray_internals/head_start.py.)"""
        began = time.monotonic()
        try:
            return ray.init(**kwargs)
        except Exception as exc:
            raise start_failure(exc, self.joined, time.monotonic() - began) from None

    def __exit__(self, *exc) -> None:
        if self.reused or self.keep_open:
            return
        self.close()

    def close(self) -> None:
        # The shutdown runs to its end whatever the user presses (orchestrator/driver/interrupts.py).
        with DeferredInterrupt() as guard:
            ours = [] if self.joined else descendants(os.getpid())
            sockets = socket_folders(ours)
            if not self.joined:
                stopping()
                self.release_dashboard_port()
                stop_autoscaler_monitor()
            ray.shutdown()
            # After the job's end: a worker the raylet stops then has its forked process
            # stopped by the server (fork_server/server.py: client_gone).
            self.stop_fork_server()
            if not self.joined:  # and what was started meanwhile, orphaned to us since
                ours = sorted(set(ours) | set(descendants(os.getpid())))
            stop_leftovers(ours, LEFTOVER_GRACE_S)
            if not self.joined:
                release_orphans(ours)
            for folder in sockets:  # of processes stopped, not ended: left to us
                shutil.rmtree(folder, ignore_errors=True)
            remove_dead_dirs()  # those of this node's processes that were killed
        self._closed.set()  # the background start's thread may end now
        self.interrupted = guard.seen

    def release_dashboard_port(self) -> None:
        """A dashboard that never started (the command ended first) holds its port no more."""
        if self._dashboard_hold is not None:
            self._dashboard_hold.release()

    @property
    def outlives_run(self) -> bool:
        """The job goes on after this run (a sweep's, a service's): what the run started must
        end with it."""
        return self.reused or self.keep_open

    @staticmethod
    def total_cpus() -> float:
        return float(ray.cluster_resources().get("CPU", 1.0))

    @staticmethod
    def total_gpus() -> float:
        return float(ray.cluster_resources().get("GPU", 0.0))

    @staticmethod
    def metrics_url() -> str | None:
        """The Prometheus endpoint of this node's Ray metrics agent (where the recorder's
        metrics are exported), or None when metrics collection is off."""
        here = ray.get_runtime_context().get_node_id()
        for node in ray.nodes():
            port = node.get("MetricsExportPort") or 0
            if node.get("NodeID") == here and port > 0:
                return f"http://{node['NodeManagerAddress']}:{port}/metrics"
        return None

    @staticmethod
    def dashboard_token_hint() -> str:
        """How to sign in to the dashboard: Ray 2.60 turns token authentication on."""
        if not token_auth_enabled():
            return "no token needed"
        return f"sign in with the token in {token_location()}, or run `ray get-auth-token`"

