"""Values for the JSON files a run leaves (run.json, sweep.json), readable by strict parsers."""

from __future__ import annotations

import math


def finite(value):
    """NaN and infinities as null: jq, JavaScript's JSON.parse and Go refuse Python's NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value
