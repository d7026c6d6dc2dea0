"""Ray core's private APIs and files the orchestrator leans on, each in one place.

A Ray upgrade may rename any of these; tests/test_ray_internals.py checks each against the
installed Ray. Where one can fail without costing the run, it degrades to something public.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger("orchestrator")

CURRENT_CLUSTER_FILE = Path("/tmp/ray/ray_current_cluster")  # written by `ray start --head`


def free_resources_per_node() -> dict[str, dict[str, float]]:
    """{node id: {resource: amount free now}}; empty if Ray no longer offers it."""
    try:
        from ray._private.state import available_resources_per_node

        return dict(available_resources_per_node())
    except Exception as exc:  # private: a renamed function costs the detail, not the run
        log.debug("free resources per node unavailable: %s", exc)
        return {}


def use_token_auth_if_available() -> None:
    """A head started by `ray start` turns token auth on when a token exists, but in Ray 2.60
    a driver joining it does not (it retries for ~20 s, then fails): do what the head did.
    Ray's helper also refreshes its cached config, which setting RAY_AUTH_MODE alone does not.
    Ray 2.59's helper takes no argument; Ray 2.58 has none: the mode is set as a user of 2.58
    does by hand, and Ray's config, read at its import, read again (what the helper does)."""
    try:
        from ray._private.authentication import authentication_token_setup as auth

        enable = auth.maybe_enable_token_auth_if_token_available
    except (ImportError, AttributeError):
        enable = None
    if enable is not None:
        try:
            enable(warn_if_disabled=False)
        except TypeError:
            enable()
        return
    if not os.environ.get("RAY_AUTH_MODE") and token_exists():
        os.environ["RAY_AUTH_MODE"] = "token"
        from ray._raylet import AuthenticationTokenLoader, Config

        AuthenticationTokenLoader.instance().reset_cache()
        Config.initialize("")


def token_exists() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token"
    return Path(path).is_file()


# The module whose logger prints "Token authentication is enabled for this Ray cluster. Set
# RAY_AUTH_MODE=disabled to opt out" when a driver starts Ray with a token and no mode set.
TOKEN_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"
TOKEN_NOTICE = "Token authentication is enabled"


class NoTokenAuthNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return TOKEN_NOTICE not in record.getMessage()


def without_token_auth_notice() -> None:
    """A quiet console (correctness of what users read, not speed): a sweep's Ray prints the
    notice above as it starts, where a plain command's quiet Ray loggers do not; the sweep's
    dashboard line already says how to sign in with the token."""
    logging.getLogger(TOKEN_NOTICE_LOGGER).addFilter(NoTokenAuthNotice())


def token_auth_enabled() -> bool:
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    return bool(is_token_auth_enabled())


def token_location() -> str:
    """Where this driver's Ray token comes from, as a user would name it."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "$RAY_AUTH_TOKEN"
    return os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token"


def stop_autoscaler_monitor() -> None:
    """Kill an embedded cluster's autoscaler monitor before ray.shutdown(). Ray stops its
    processes one at a time, a SIGTERM then up to 1 s before a SIGKILL each, and the monitor
    (idle: an embedded cluster has no autoscaler) does not end on SIGTERM: 1.0 of the 1.4 s of
    every command's ray.shutdown() was spent waiting for it. Ray would SIGKILL it after that
    second anyway."""
    try:
        from ray._private import ray_constants
        from ray._private.worker import _global_node

        processes = _global_node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, [])
    except Exception as exc:  # private: a renamed attribute costs the second, not the run
        log.debug("Ray's monitor process not found: %s", exc)
        return
    for info in processes:
        if info.process.poll() is None:
            info.process.kill()
            info.process.wait(timeout=5)


_shutdown_left_out = False
# The threads ray.init's connect starts in a driver (ray/_private/worker.py).
RAY_DRIVER_THREADS = ("ray_listen_error_messages", "ray_print_logs")
_excepthook_before = threading.excepthook


def _ray_threads_quiet(args) -> None:
    if _shutdown_left_out and args.thread is not None and args.thread.name in RAY_DRIVER_THREADS:
        return
    _excepthook_before(args)


def no_ray_shutdown_at_exit() -> None:
    """Leave out Ray's own ray.shutdown() at the interpreter's exit (registered when Ray is
    imported). After a command killed the cluster it started, that shutdown waits on the dead
    GCS: ~6 s, and where the kill came while ray.init was connecting, 60 s before Ray's GCS
    client ends the process with exit code 1 and its own error lines. Ray's driver threads
    that lose that GCS end quietly: the error listener's first call, killed under it, raised
    a traceback after the command's one error line (a clean clone's run, on a fast hour)."""
    global _shutdown_left_out, _excepthook_before
    from ray._private import worker

    atexit.unregister(worker.shutdown)
    _shutdown_left_out = True
    if threading.excepthook is not _ray_threads_quiet:
        _excepthook_before, threading.excepthook = threading.excepthook, _ray_threads_quiet


def ray_shutdown_at_exit() -> None:
    """Ray's own ray.shutdown() at the interpreter's exit again, where it was left out (a
    service's later session); elsewhere Ray's own registration stays as it is."""
    global _shutdown_left_out
    if not _shutdown_left_out:
        return
    from ray._private import worker

    atexit.register(worker.shutdown, _exiting_interpreter=True)
    _shutdown_left_out = False


def exited_ray_process() -> str | None:
    """Which of the GCS and the raylet this process started has exited (a Ray it holds across
    commands, killed or crashed since), else None; None too for a Ray it joined."""
    try:
        from ray._private import ray_constants
        from ray._private.worker import _global_node

        table = _global_node.all_processes if _global_node is not None else {}
        kinds = (ray_constants.PROCESS_TYPE_GCS_SERVER, ray_constants.PROCESS_TYPE_RAYLET)
    except Exception as exc:  # private: a renamed attribute costs the check, not the command
        log.debug("Ray's process table unavailable: %s", exc)
        return None
    for kind in kinds:
        for info in table.get(kind, []):
            if info.process.poll() is not None:
                return kind
    return None


def placed_but_not_started(actor_class: str = "RayTrainWorker") -> list[str]:
    """The node ids where this job's placement groups are placed and its ``actor_class`` actors
    still wait to be created: their processes are not starting. (A process that dies as it
    starts never registers; the raylet starts another every 60 s, holding the group's CPUs,
    so the cluster looks full.) Empty where Ray no longer offers the tables."""
    try:
        import ray
        from ray._private import state
        from ray.util.placement_group import placement_group_table

        job = ray.get_runtime_context().get_job_id()
        # A placement group's id ends with its job's id.
        placed = [g for g in placement_group_table().values()
                  if g["placement_group_id"].endswith(job) and g["state"] == "CREATED"]
        waiting = [a for a in state.actors().values() if a.get("JobID") == job
                   and str(a.get("ActorClassName")).rsplit(".", 1)[-1] == actor_class
                   and a.get("State") in ("PENDING_CREATION", "DEPENDENCIES_UNREADY")]
    except Exception as exc:  # private: a renamed table costs the detail, not the run
        log.debug("placement and actor tables unavailable: %s", exc)
        return []
    if not placed or not waiting:
        return []
    return sorted({node for g in placed for node in g["bundles_to_node_id"].values()})


def log_size(log_file: Path | None) -> int:
    try:
        return log_file.stat().st_size if log_file else 0
    except OSError:
        return 0


def last_error_line(log_file: Path, since: int = 0) -> str | None:
    """The last line of a Python exception written to one of Ray's .err logs after byte
    ``since`` (a worker process that died as it started prints its traceback there), or None."""
    try:
        with open(log_file, "rb") as f:
            f.seek(max(since, f.seek(0, os.SEEK_END) - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        name, sep, _ = line.partition(": ")
        if sep and name.isidentifier() and name.endswith(("Error", "Exception")):
            return line.strip()[:300]
    return None


def raylet_error_log() -> Path | None:
    """This node's raylet.err (where a worker process that dies before it connects prints its
    traceback), for a driver connected to Ray."""
    try:
        from ray._private.worker import _global_node

        return Path(_global_node.get_logs_dir_path()) / "raylet.err"
    except Exception as exc:  # private: a renamed attribute costs the hint, not the run
        log.debug("Ray's log folder unknown: %s", exc)
        return None
