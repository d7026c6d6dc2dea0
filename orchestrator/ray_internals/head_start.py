"""How ray.init starts a head the command starts itself (an embedded cluster): its dashboard
beside its raylet instead of before it, at a lower priority, and not waited for; no log
monitor where nothing reads what it sends, and no autoscaler monitor where nothing can be
autoscaled.

ray.init starts a head's processes in turn: the GCS, the autoscaler monitor, the dashboard,
then the log monitor and the raylet, and it waits for the dashboard to publish its address
before it starts the raylet (~1.8 s of imports and module processes on 2 cores), then for the
raylet to register (~1 s: it waits for its dashboard agent). The raylet needs nothing of the
dashboard but that address, which it hands to the workers it starts; where the command chose
the dashboard's host and port, the address is known before the dashboard starts. So the
dashboard starts in a thread and the raylet starts at once with that address. Ray asks the
kernel to kill a process when the thread that started it ends (PR_SET_PDEATHSIG), so the
thread that started the dashboard lives as long as its process.

The dashboard runs 15 nice levels below the command, as Ray runs its workers, and ray.init
does not wait for it: it waited ~3.4 s for the dashboard to publish its address (2026-11-28,
ray.init's steps timed in one default command on 2 cores), and at Ray's usual priority the
dashboard's start (~2.8 CPU-s: its imports, a fork server and nine module processes, which
inherit its niceness) took CPU from the driver's start and from the workers (nice 15) all the
while. The dashboard now answers a few seconds after the run began. A dashboard that does not start is a warning, not the run's
end (Ray's own error lines about it still print); one stopped by the command's own shutdown
says nothing. (Its process is reniced within milliseconds of its start, before it starts its
module processes: process_starts.lower_priority_of_starts.) `python scripts/bench.py
fixed_cost --repeats 4` against the tree before, twice: 11.52 vs 12.33 s to exit, then 10.75
vs 10.53 s an hour later (results/2026-11-28-fixed_cost-dashboard-nice.json, -2.json): on 2
cores the command is CPU-bound, and this reorders the dashboard's CPU more than it removes it;
no wall-time gain is established. What it surely gives: ray.init ~1.1 s sooner, a dashboard
that never outranks the training, and a run that outlives a dashboard that failed.

A command's dashboard (a plain command's or a service's head, not a sweep's) starts once its
run's workers have started, or DASHBOARD_DEFER_MAX_S after Ray's start if they have not: its
start (~1.5 CPU-s with its module processes) no longer lands on the 2 cores while the workers
start, the longest path of a short run (the default job without any dashboard: 8.09 vs 8.51 s,
results/2026-11-29-fixed_cost-no-dashboard.json; deferred, 13.8 vs 15.4 CPU-s a command). A
short run may end before its dashboard answers.

Whether the dashboard's packages are installed is asked without importing them
(dashboard_packages.py, ~0.3 CPU-s on ray.init's thread).

ray.init then waits for the raylet to register with the GCS, asking it once a second (Ray
core's GlobalStateAccessor::GetNode sleeps 1 s between asks): ~0.5 s lost on average, up to 1 s.
The head's start now asks every REGISTER_POLL_S first; Ray's own wait then finds the node at
its first ask. Ray's wait gives up after a fixed 30 s, which a loaded machine misses; this one
waits REGISTER_WAIT_S while the raylet lives (correctness: a busy machine delays the start, it
does not fail it). The raylet's two agents stay at Ray's priority: the raylet gives each 15 s
to write down its ports and crashes when one misses that ("Timed out waiting for file
.../metrics_agent_port_..."); put at the dashboard's priority (3% off a quiet machine's
command, results/2026-11-29-fixed_cost-agents-nice.json), they missed it beside two busy
loops, every time.

The log monitor sends the workers' output to drivers that ask for it (ray.init's
log_to_driver); a command that does not (log.ray_verbose=false) need not start it
(~0.45 CPU-s).

The autoscaler monitor (monitor.py) of a head started without an autoscaling config has no
nodes to add or remove: it reports the cluster's load for `ray status` and the dashboard's
autoscaler panel, and costs ~0.5 CPU-s while the command starts (Ray's idle monitor also holds
its shutdown 1 s: cluster.stop_autoscaler_monitor). A command's own head starts without one;
a service's head, which users may inspect with `ray status` for hours, keeps it.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
import time
import weakref

from ray._common.network_utils import build_address
from ray._private import node as ray_node
from ray._private import ray_constants

from orchestrator.ray_internals import dashboard_packages  # noqa: F401  (asks without imports)
from orchestrator.ray_internals.process_starts import (
    StartsClosed,
    lower_priority_of_starts,
    thread_for,
)

log = logging.getLogger("orchestrator")

_ray_start_api_server = ray_node.Node.start_api_server
_ray_node_init = ray_node.Node.__init__
_ray_start_ray_processes = ray_node.Node.start_ray_processes
_enabled = threading.local()
REGISTER_POLL_S = 0.02
# Ray's own wait for the registration is a fixed 30 s (node.py's raylet_start_wait_time_s):
# on a loaded machine (load 15-50 on 2 cores) ~1 cold start in 6 failed it ("The current node
# timed out during startup"), and the same command run again worked. While its raylet lives,
# a node is waited for this long; Ray's wait then finds it at once (or gives its own error).
REGISTER_WAIT_S = 180.0
# Ray runs its workers 15 nice levels down (its worker_niceness), so that its own processes
# stay responsive; the dashboard goes there too: it must not take the training's CPU.
DASHBOARD_NICENESS = 15
# A command's dashboard starts once its workers have (dashboard_may_start), or this long after
# Ray's start, whichever comes first.
DASHBOARD_DEFER_MAX_S = 15.0
DASHBOARD_START_WAIT_S = 600
_workers_started = threading.Event()


class _DashboardStart:
    """The dashboard's start, run by a thread of its own."""

    def __init__(self, node: ray_node.Node, options: dict, deferred: bool, port_hold=None):
        self.node = node
        self.options = options
        self.deferred = deferred
        self.port_hold = port_hold  # the port, held for it until it starts (driver/ports.py)
        self.published = threading.Event()  # its start ended: published, or failed
        self.stopping = False  # the command is stopping this Ray: a failure is not news
        _starts.add(self)

    def run(self) -> None:
        if self.deferred:
            _workers_started.wait(DASHBOARD_DEFER_MAX_S)
        if self.port_hold is not None:
            self.port_hold.release()  # Ray's own check binds it next
        if self.stopping:  # the command ended first: no dashboard to start
            self.published.set()
            return
        lower_priority_of_starts(DASHBOARD_NICENESS)
        try:
            _ray_start_api_server(self.node, **self.options)
        except BaseException as exc:  # noqa: BLE001  (Ray's own messages: many lines)
            # StartsClosed: the command abandoned this Ray while it started (its input was
            # bad), possibly before this start was made: not news either.
            if not self.stopping and not isinstance(exc, StartsClosed):
                log.warning("the Ray dashboard did not start (%s); the run goes on without it",
                            dashboard_failure(exc))
        self.published.set()
        for info in self.node.all_processes.get(ray_constants.PROCESS_TYPE_DASHBOARD, []):
            info.process.wait()  # this thread's end would kill the dashboard


_starts: weakref.WeakSet[_DashboardStart] = weakref.WeakSet()
LOG_TAIL = re.compile(r"^The last \d+ lines of (?P<log>.+?) \(it contains the error message")


def dashboard_failure(exc: BaseException) -> str:
    """Ray's error for a dashboard that did not start, in a few words: the last line of the
    dashboard's log and where that log is, where Ray's message quotes it (its first line only
    announces the quote), else its first line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    quoted = LOG_TAIL.match(lines[0]) if lines else None
    if quoted and len(lines) > 1:
        return f"{lines[-1][:200]}; its log: {quoted['log']}"
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


def stopping() -> None:
    """The command stops the Ray it started: a dashboard still starting fails for that."""
    for start in list(_starts):
        start.stopping = True
    _workers_started.set()  # a start still deferred ends at once


def dashboard_may_start() -> None:
    """The run's workers have started: a deferred dashboard starts now."""
    _workers_started.set()


@functools.wraps(_ray_start_api_server)
def _start_api_server(self: ray_node.Node, *, include_dashboard, raise_on_failure):
    params = self._ray_params
    if not (getattr(_enabled, "on", False) and include_dashboard and params.dashboard_port):
        return _ray_start_api_server(self, include_dashboard=include_dashboard,
                                     raise_on_failure=raise_on_failure)
    # Ray waits RAY_DASHBOARD_STARTUP_TIMEOUT_S (60 s) for the dashboard to publish its
    # address, then reports it failed: at nice 15 on a loaded machine it took longer. Its start
    # holds nothing up here (a thread of its own), so it is given the time it needs.
    ray_constants.RAY_DASHBOARD_STARTUP_TIMEOUT_S = max(
        ray_constants.RAY_DASHBOARD_STARTUP_TIMEOUT_S, DASHBOARD_START_WAIT_S)
    start = _DashboardStart(self, {"include_dashboard": include_dashboard,
                                   "raise_on_failure": raise_on_failure},
                            deferred=getattr(_enabled, "defer_dashboard", False),
                            port_hold=getattr(_enabled, "dashboard_port_hold", None))
    self._orchestrator_dashboard_start = start
    thread_for(start.run, "ray-dashboard-start").start()
    self._webui_url = build_address(params.dashboard_host, params.dashboard_port)


@functools.wraps(_ray_node_init)
def _node_init(self: ray_node.Node, ray_params, *args, **kwargs):
    if getattr(_enabled, "on", False) and not _enabled.log_monitor:
        ray_params.include_log_monitor = False  # kept: Ray sets it only where it is None
    if getattr(_enabled, "on", False) and not _enabled.monitor:
        ray_params.no_monitor = True
    if getattr(_enabled, "on", False):
        agent_ports(ray_params)
    _ray_node_init(self, ray_params, *args, **kwargs)


def agent_ports(ray_params) -> None:
    """ray.init has no key for the dashboard agent's HTTP port: a fixed 52365, taken by any
    other Ray on the machine (its agent then serves no HTTP: no `ray job submit` to this
    head). 0: one the kernel gives, which the agent writes down for the raylet, as it does
    for its other ports."""
    if ray_params.dashboard_agent_listen_port == ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT:
        ray_params.dashboard_agent_listen_port = 0


@functools.wraps(_ray_start_ray_processes)
def _start_ray_processes(self: ray_node.Node):
    _ray_start_ray_processes(self)
    if getattr(_enabled, "on", False):
        wait_for_registration(self)


def wait_for_registration(node: ray_node.Node) -> None:
    """Until the node's raylet has registered with the GCS, asked every REGISTER_POLL_S, up
    to REGISTER_WAIT_S while the raylet lives. A raylet that exited, or an ask that cannot be made, leaves the
    verdict to Ray's own wait, which comes next; an ask the busy GCS did not answer in time is
    asked again."""
    from ray._raylet import NodeID
    from ray.core.generated.gcs_pb2 import GcsNodeInfo
    from ray.core.generated.gcs_service_pb2 import GetAllNodeInfoRequest

    try:
        selector = GetAllNodeInfoRequest.NodeSelector(node_id=NodeID.from_hex(node.node_id).binary())
        client = node.get_gcs_client()
        raylets = node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])
        deadline = time.monotonic() + REGISTER_WAIT_S
        while time.monotonic() < deadline and all(r.process.poll() is None for r in raylets):
            try:
                if client.get_all_node_info(timeout=5, node_selectors=[selector],
                                            state_filter=GcsNodeInfo.GcsNodeState.ALIVE):
                    return
            except Exception as exc:  # noqa: BLE001  (a GCS that busy: ask again)
                log.debug("the GCS did not answer yet: %s", exc)
            time.sleep(REGISTER_POLL_S)
    except Exception as exc:  # noqa: BLE001  (Ray's own wait decides)
        log.debug("not waiting for the raylet's registration: %s", exc)


@contextlib.contextmanager
def embedded_head(log_monitor: bool, monitor: bool = True, defer_dashboard: bool = False,
                  dashboard_port_hold=None):
    """For a ray.init in this thread that starts a head (a dashboard with a chosen port starts
    beside the raylet); ``log_monitor``, ``monitor``: whether the head starts its log monitor,
    its autoscaler monitor; ``defer_dashboard``: its dashboard starts at dashboard_may_start()
    (or DASHBOARD_DEFER_MAX_S later), not beside the raylet; ``dashboard_port_hold``: what
    holds the dashboard's port until it starts (its ``release()`` is called then). The
    dashboard agent's HTTP port is one the kernel gives."""
    _enabled.on, _enabled.log_monitor, _enabled.monitor = True, log_monitor, monitor
    _enabled.defer_dashboard = defer_dashboard
    _enabled.dashboard_port_hold = dashboard_port_hold
    if defer_dashboard:
        _workers_started.clear()
    try:
        yield
    finally:
        _enabled.on = False


def installed() -> bool:
    return ray_node.Node.start_api_server is _start_api_server and \
        ray_node.Node.start_ray_processes is _start_ray_processes


ray_node.Node.start_api_server = _start_api_server
ray_node.Node.__init__ = _node_init
ray_node.Node.start_ray_processes = _start_ray_processes
