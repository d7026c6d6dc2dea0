"""Ray's private APIs the orchestrator leans on, each in one place with a fallback.

A Ray upgrade may rename any of these; each use here degrades to something public (and says
so in the log) instead of failing the run.
"""

from __future__ import annotations

import logging

log = logging.getLogger("orchestrator")


def free_resources_per_node() -> dict[str, dict[str, float]]:
    """{node id: {resource: amount free now}}; empty if Ray no longer offers it."""
    try:
        from ray._private.state import available_resources_per_node

        return dict(available_resources_per_node())
    except Exception as exc:  # private: a renamed function costs the detail, not the run
        log.debug("free resources per node unavailable: %s", exc)
        return {}
