"""Ray's own process starts, closed to a thread whose Ray the command abandoned.

A plain command starts its embedded Ray in a background thread beside the trial of the user's
parts (orchestrator/driver/session_start.py); when the trial fails, the command kills what
Ray started and exits. That thread may be about to start one more of Ray's processes: started
after the kill, a raylet found no GCS and exited, but first started its dashboard agent, which
outlived the command (a clean clone's run found it). Every process `ray.init` starts goes
through ``ray._private.services.start_ray_process`` (the GCS, the raylet, the dashboard, the
monitors); closing a thread to it, under the lock every start holds, means that once
``close_starts`` returns, each process that thread ever starts is already running, so the
caller's kill of the process tree finds them all. A thread a closed one started on its behalf
(``thread_for``: the dashboard's start, head_start.py) is closed with it. A thread may also
ask for the processes it starts to run at a lower priority (``lower_priority_of_starts``: the
dashboard's), set within milliseconds of each start, before the process starts any of its
own, which inherit it.
"""

from __future__ import annotations

import os
import threading
import weakref

from ray._private import services

_lock = threading.Lock()
_closed: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_owners: weakref.WeakKeyDictionary[threading.Thread, threading.Thread] = weakref.WeakKeyDictionary()
_ray_start_process = services.start_ray_process
_here = threading.local()


class StartsClosed(RuntimeError):
    """Raised in a thread closed to Ray's process starts: its ray.init ends there."""


def _start_ray_process(*args, **kwargs):
    with _lock:
        here = threading.current_thread()
        if here in _closed or _owners.get(here) in _closed:
            raise StartsClosed("the command abandoned the Ray this thread was starting")
        info = _ray_start_process(*args, **kwargs)
    levels = getattr(_here, "nicer", 0)
    if levels:
        os.setpriority(os.PRIO_PROCESS, info.process.pid, os.getpriority(os.PRIO_PROCESS, 0) + levels)
    return info


def lower_priority_of_starts(levels: int) -> None:
    """Ray's processes this thread starts from now on run ``levels`` nice levels below it."""
    _here.nicer = levels


def close_starts(thread: threading.Thread) -> None:
    """No process of Ray's starts from ``thread`` any more; one it was starting has started."""
    with _lock:
        _closed.add(thread)


def thread_for(target, name: str) -> threading.Thread:
    """A daemon thread (not started) whose process starts are closed with this thread's."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    with _lock:
        here = threading.current_thread()
        _owners[thread] = _owners.get(here, here)
    return thread


def installed() -> bool:
    return services.start_ray_process is _start_ray_process


# Module-level calls inside ray._private.services look the name up when they run.
services.start_ray_process = _start_ray_process
