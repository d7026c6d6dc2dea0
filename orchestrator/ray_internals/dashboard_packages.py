"""Whether the dashboard's packages are installed, asked of the file system, not by importing
them.

Ray's node asks before it starts the dashboard and again before it starts the raylet (whose
dashboard agent runs ``--minimal`` without them), and it asks by importing every module of
``ray.dashboard.optional_deps``: aiohttp, opencensus, OpenTelemetry's exporter, prometheus_client
and more, ~0.3 CPU-s of imports the command never uses, made in the driver while its Ray
starts (on ray.init's own thread, before the raylet). Here the same modules, read from that
file (so a Ray upgrade that lists others is followed), are looked up where Python would find
them instead. What this cannot see is a package installed but broken: its dashboard then
fails at its start, a warning (head_start.py), not the run's end.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import sys

from ray._private import utils as ray_utils


@functools.cache
def listed_modules() -> tuple[str, ...]:
    """The modules Ray's optional_deps.py imports, in its order."""
    spec = importlib.util.find_spec("ray.dashboard.optional_deps")
    with open(spec.origin, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return tuple(dict.fromkeys(names))


def findable(name: str) -> bool:
    """Whether ``import name`` would find a module, without importing it (nor its parents)."""
    top, *rest = name.split(".")
    module = sys.modules.get(top)
    if module is not None and not rest:
        return True
    spec = getattr(module, "__spec__", None) or importlib.util.find_spec(top)
    if spec is None:
        return False
    if not rest:
        return True
    stem = rest[-1]
    for location in spec.submodule_search_locations or ():
        folder = os.path.join(location, *rest[:-1])
        if os.path.isdir(os.path.join(folder, stem)) or (os.path.isdir(folder) and any(
                entry == f"{stem}.py" or entry.startswith(f"{stem}.cpython")
                for entry in os.listdir(folder))):
            return True
    return False


def dashboard_dependency_error() -> ImportError | None:
    """Ray's get_dashboard_dependency_error, answered without the imports."""
    for name in listed_modules():
        if not findable(name):
            return ImportError(f"No module named '{name}'", name=name)
    return None


def installed() -> bool:
    return ray_utils.get_dashboard_dependency_error is dashboard_dependency_error


ray_utils.get_dashboard_dependency_error = dashboard_dependency_error
