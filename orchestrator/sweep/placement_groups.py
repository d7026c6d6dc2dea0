"""The sweep driver's Tune callback that removes the placement groups of stopped trials
(orchestrator/ray_internals/pg_cleaner.py says why, and how the trials register them)."""

from __future__ import annotations

import logging
import time

from ray import tune

from orchestrator.ray_internals.pg_cleaner import remove_orphaned_groups

log = logging.getLogger("orchestrator")


class RemoveOrphanedGroups(tune.Callback):
    """Tune's loop calls ``on_step_begin`` many times a second: a pass at most every
    ``every_s``."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s = every_s
        self._last = 0.0

    def on_step_begin(self, iteration, trials, **info) -> None:
        if time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            try:
                remove_orphaned_groups()
            except Exception as exc:  # noqa: BLE001  (the GCS busy: the next pass)
                log.debug("placement groups not checked: %s", exc)
