"""The job's entrypoint as Ray records it, redacted.

ray.init records the driver's command line as its job's entrypoint
(ray._private.utils.get_entrypoint_name: the process's argv), and the dashboard shows it on its
Jobs page and with every run on its Train page. A secret given on the command line
(`+trainer.api_token=...`) would be stored in the cluster and shown there: the recorded line
is redacted as every log line of the command is (orchestrator/redaction.py). A private hook
(tests/test_ray_internals.py): if a Ray upgrade moves it, the line is recorded as Ray does.
"""

from __future__ import annotations

import functools


def redacted_entrypoint() -> None:
    """From now on, the entrypoint Ray records for a job this process starts is redacted."""
    try:
        from ray._private import utils
    except ImportError:
        return
    real = getattr(utils, "get_entrypoint_name", None)
    if real is None or getattr(real, "redacted", False):
        return

    @functools.wraps(real)
    def get_entrypoint_name() -> str:
        from orchestrator.redaction import redact_text

        return redact_text(real())

    get_entrypoint_name.redacted = True
    utils.get_entrypoint_name = get_entrypoint_name
