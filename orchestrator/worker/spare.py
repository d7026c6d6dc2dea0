"""A process kept ready on this worker's node for the worker that replaces it after a failure.

Ray Train answers a failure with a new worker group, whose every worker is a new actor in a
new process: Python and Ray imported before anything of the run's own starts (~2 s of a 5 s
recovery on this 2-core machine, scripts/bench.py recovery). failure.spare_after_s after its
start, each worker asks its node's raylet for one idle process like its own
(ray_internals/prestart.py); the next group's worker placed on that node starts in it.
Asked late, so a short run never pays for a process it will not use (with torch imported
ahead, orchestrator/worker/warm.py: ~2-3 CPU-seconds to start, 240-310 MiB idle, measured
here); not in a sweep's trials, whose job outlives them (the spare would stay idle until the
sweep ends).
"""

from __future__ import annotations

import threading

from orchestrator.ray_internals.prestart import prestart_like_this_process


def ask_for_spare_later(after_s: float | None, recorder, says: bool) -> threading.Timer | None:
    """Start the clock (at the worker's start); cancel the returned timer when the worker ends.
    ``says``: this worker (rank 0) reports a refusal, which every worker would meet alike."""
    if after_s is None:
        return None

    def ask() -> None:
        problem = prestart_like_this_process(1)
        if problem and says:  # the restart then starts processes as Ray does; in run.json
            recorder.warning.remote(f"no process kept ready for a restart ({problem})")

    timer = threading.Timer(after_s, ask)
    timer.daemon = True
    timer.start()
    return timer
