"""The Ray and torch versions the private hooks of this package were tested on, and what a
command does on others: one line at its start, and every speed hook off (a correctness hook
that cannot install is a warning in run.json, as on any version: train_hooks.hooks_missing).

The ranges are pyproject.toml's; `make smoke` runs the smoke subset on the oldest Ray of the
range (docs/testing.md). Read from the installed packages' metadata: neither is imported.
"""

from __future__ import annotations

import functools
import os
from importlib import metadata

# (oldest, first not supported): pyproject.toml says the same
RAY_RANGE = ((2, 58), (2, 61))
TORCH_RANGE = ((2, 12), (2, 16))
# Set to 0 to run a supported version without the speed hooks too (what a version outside
# the range gets).
SPEED_HOOKS = "ORCHESTRATOR_SPEED_HOOKS"
# The speed hooks the driver chooses, by name: a comma-separated list of them in
# ORCHESTRATOR_SPEED_HOOKS_OFF runs without just those (fixed_cost's no_<name> variants
# measure what each saves, docs/benchmarks.md).
SPEED_HOOKS_OFF = "ORCHESTRATOR_SPEED_HOOKS_OFF"
HOOK_NAMES = ("callbacks", "barrier", "autoscaling", "started_ahead", "spares", "fork_server",
              "page_versions", "agreement")


def release(version: str) -> tuple[int, int]:
    """(major, minor) of "2.60.0", "2.13.0+cpu", "2.16.0.dev20261101"."""
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def outside_range(package: str, version: str | None, tested: tuple) -> str | None:
    """One line when ``version`` is outside the tested range; None inside it, or when the
    package is not installed (torch is a trainer's, not every command's)."""
    if version is None or tested[0] <= release(version) < tested[1]:
        return None
    (lo_major, lo_minor), (hi_major, hi_minor) = tested
    return (f"{package} {version} is outside the tested range {lo_major}.{lo_minor}-"
            f"{hi_major}.{hi_minor - 1}: running without the orchestrator's start-up speed-ups "
            "(its hooks into private code); if something fails, install a version in the range")


@functools.cache
def untested() -> tuple[str, ...]:
    """The lines for this environment's Ray and torch, said once at a command's start."""
    found = (outside_range("Ray", installed("ray"), RAY_RANGE),
             outside_range("torch", installed("torch"), TORCH_RANGE))
    return tuple(line for line in found if line)


def speed_hooks(name: str | None = None) -> bool:
    """The hooks that only save time (ray_internals/__init__.py says which) are installed:
    on the tested versions, unless ORCHESTRATOR_SPEED_HOOKS=0; ``name`` (one of HOOK_NAMES):
    that one, unless ORCHESTRATOR_SPEED_HOOKS_OFF names it."""
    if os.environ.get(SPEED_HOOKS, "1") == "0" or untested():
        return False
    if name is None:
        return True
    assert name in HOOK_NAMES, name
    return name not in {n.strip() for n in os.environ.get(SPEED_HOOKS_OFF, "").split(",")}
