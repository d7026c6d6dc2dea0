"""Ctrl-C on the driver once training is over: noted, never raised; during the trial of the
user's parts: raised when the trial ends (``interrupt_after``).

A KeyboardInterrupt raised inside ray.shutdown() leaves an embedded cluster half stopped, and a
Ray call made after the shutdown (a handler asking the controller to abort, say) would start
or join some other cluster (see orchestrator/__main__.py). While the run winds down (final
record, Ray's shutdown) a Ctrl-C is therefore only remembered: the command finishes its
shutdown, says so in one line and exits 130.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager

log = logging.getLogger("orchestrator")


class DeferredInterrupt:
    """Installs a SIGINT handler that remembers instead of raising, from arm() to disarm()."""

    def __init__(self) -> None:
        self.seen = False
        self._previous = None
        self._armed = False

    def _note(self, signum, frame) -> None:
        if not self.seen:
            log.warning("interrupted: finishing the shutdown first")
        self.seen = True

    def arm(self) -> None:
        if self._armed or threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.signal(signal.SIGINT, self._note)
        self._armed = True

    def disarm(self) -> None:
        if self._armed:
            # Not the handler from before the run (Ray Train's, or ours for fit()): Ray is shut
            # down, nothing is left to interrupt, and a KeyboardInterrupt now would only print
            # a traceback from some exit hook. A Ctrl-C from here on ends the command at once.
            signal.signal(signal.SIGINT, at_once[0])
            self._armed = False

    def __enter__(self) -> DeferredInterrupt:
        self.arm()
        return self

    def __exit__(self, *exc) -> None:
        self.disarm()


def exit_at_once(signum, frame) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


# What a Ctrl-C does once the run is over: a service running commands in its own process
# (orchestrator/service/server.py) ends the command there, not itself.
at_once = [exit_at_once]


# The signal that interrupted the command, for run.json's error ("interrupted (SIGTERM)").
interrupted_by = ["SIGINT"]


def sigterm_as_ctrl_c() -> None:
    """SIGTERM (kill, timeout, docker stop, a scheduler ending the job) stops a command as
    Ctrl-C does: it goes to whatever SIGINT does at that moment (abort the run and record it as
    interrupted; during the shutdown, noted). Without this the driver died at once and run.json
    said "running" for good. Installed again once Ray is up: ray.init in the main thread puts
    its own (sys.exit) in place."""
    if threading.current_thread() is not threading.main_thread() or at_once[0] is not exit_at_once:
        return  # a service's command: its client forwards SIGTERM as a Ctrl-C; the service's own stays

    def forward(signum, frame) -> None:
        interrupted_by[0] = "SIGTERM"
        if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
            # a command started in the background (`... &`) ignores SIGINT: raise it here,
            # or once interrupt_after's block ends
            if _held:
                _held[-1].append(signum)
                return
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGINT)

    signal.signal(signal.SIGTERM, forward)


# The signals held by the interrupt_after blocks now running, where Ctrl-C is ignored.
_held: list[list[int]] = []


@contextmanager
def interrupt_after():
    """A Ctrl-C while the block runs is raised as it ends; a second one at once. The block
    imports a framework (the trial of the user's parts imports torch): a KeyboardInterrupt
    raised in Python code that torch's C++ calls back through pybind11 during its import ends
    the process with SIGABRT ("terminate called after throwing an instance of
    'pybind11::error_already_set'"), not with the command's exit code 130. Only the main
    thread gets signals; where Ctrl-C is ignored (a background job) it stays ignored, and a
    SIGTERM is what is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    seen: list[int] = []
    if previous in (signal.SIG_IGN, None):
        # Ctrl-C stays ignored; a SIGTERM (sigterm_as_ctrl_c) is held as a Ctrl-C would be
        _held.append(seen)
        try:
            yield
        finally:
            _held.remove(seen)
        if seen:
            raise KeyboardInterrupt
        return

    def note(signum, frame) -> None:
        if seen:  # pressed again: the user does not want to wait
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt
        seen.append(signum)

    signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if seen:
        raise KeyboardInterrupt
