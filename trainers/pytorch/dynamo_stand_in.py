"""The driver's trial of the user's parts without importing torch._dynamo.

torch.optim imports torch._dynamo (about a CPU-second: the largest part of the trial, on the
path from the command to the first step) only to mark its methods as not to be compiled: an
optimizer's constructor (``add_param_group``) and every ``step`` call
``torch._dynamo.disable`` and ``graph_break``. The trial never compiles, so a stand-in module
takes torch._dynamo's place for it: its ``disable`` remembers what it was asked to mark, and
its ``graph_break`` does nothing (as the real one does outside compiled code). The first use
of anything else (a part that calls ``torch.compile``, sets ``torch._dynamo.config``, or
imports one of its submodules) loads the real module, which takes over and marks what the
stand-in had been asked to: from then on the process is as if the real module had been there
from the start. After the trial no trace of the stand-in is left.

Only the driver's trial: a worker's DDP constructor asks torch._dynamo.utils for its mode, and
DCP imports it, so every PyTorch worker needs the real one (imported ahead by Ray's setup hook:
orchestrator/worker/warm.py).

torch's internals in one place: tests/test_pytorch_tasks.py checks, in fresh interpreters,
that the default parts' trial imports no torch._dynamo, that parts which compile (or import
its submodules first) pass in one trial, and that what was marked is marked by the real module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from contextlib import contextmanager
from importlib.machinery import ModuleSpec

NAME = "torch._dynamo"
MARK = "__dynamo_disable"  # where torch caches what disable gave (a string: no name mangling)


class _StandIn(types.ModuleType):
    """torch._dynamo as torch.optim and DDP use it outside compiled code."""

    def __init__(self, spec: ModuleSpec) -> None:
        super().__init__(NAME)
        self.__spec__ = spec
        self.__path__ = list(spec.submodule_search_locations or [])  # a package, to importlib
        self._marked: list[tuple] = []  # (function, recursive): what disable was asked for
        self._real = None

    def disable(self, fn=None, recursive=True, **kwargs):
        if self._real is not None:
            return self._real.disable(fn, recursive, **kwargs)
        if fn is None:
            return lambda f: self.disable(f, recursive, **kwargs)
        self._marked.append((fn, recursive))
        return fn

    def graph_break(self, *args, **kwargs) -> None:
        if self._real is not None:
            self._real.graph_break(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__"):  # what import machinery and copy probe: not there
            raise AttributeError(name)
        return getattr(self.load_real(), name)

    def load_real(self):
        if self._real is None:
            if sys.modules.get(NAME) is self:
                del sys.modules[NAME]
            self._real = importlib.import_module(NAME)
            _remove_finder()
            self._mark_for_real()
        return self._real

    def _mark_for_real(self) -> None:
        """What torch cached from our disable (the function itself) becomes what the real
        one gives, as if it had been there when torch asked."""
        for fn, recursive in self._marked:
            if fn.__dict__.get(MARK) is fn:
                setattr(fn, MARK, self._real.disable(fn, recursive, wrapping=False))
        self._marked.clear()

    def forget(self) -> None:
        """Leave the process as if this module had never been there."""
        _remove_finder()
        if sys.modules.get(NAME) is self:
            del sys.modules[NAME]
        torch = sys.modules.get("torch")
        if torch is not None and torch.__dict__.get("_dynamo") is self:
            delattr(torch, "_dynamo")
        for fn, _ in self._marked:
            if fn.__dict__.get(MARK) is fn:
                delattr(fn, MARK)
        self._marked.clear()


class _Loaded(importlib.abc.Loader):
    """A module the real torch._dynamo already imported: given as it is (not run twice)."""

    def __init__(self, module: types.ModuleType):
        self.module, self.own_spec = module, module.__spec__

    def spec(self) -> ModuleSpec:
        return ModuleSpec(self.module.__name__, self, origin=getattr(self.own_spec, "origin", None))

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        module.__spec__ = self.own_spec  # importlib set ours; the module's own goes back


class _RealForSubmodules(importlib.abc.MetaPathFinder):
    """An import of torch._dynamo.<anything> loads the real torch._dynamo first."""

    def find_spec(self, fullname, path, target=None):
        stand_in = sys.modules.get(NAME)
        if not fullname.startswith(NAME + ".") or not isinstance(stand_in, _StandIn):
            return None
        stand_in.load_real()
        module = sys.modules.get(fullname)
        if module is None:
            return None  # the path finder loads it, from the real package's folder
        return _Loaded(module).spec()


_FINDER = _RealForSubmodules()


def _remove_finder() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def install() -> _StandIn | None:
    """Put the stand-in in place where torch._dynamo is not imported yet; return it."""
    if NAME in sys.modules:
        return None
    spec = importlib.util.find_spec(NAME)  # where it is: nothing of it runs
    if spec is None:
        return None
    stand_in = _StandIn(spec)
    sys.modules[NAME] = stand_in
    sys.meta_path.insert(0, _FINDER)
    return stand_in


@contextmanager
def without_dynamo():
    """Run the block with the stand-in, and leave no trace of it. Yields whether it stood
    in."""
    stand_in = install()
    try:
        yield stand_in is not None
    finally:
        if stand_in is not None:
            stand_in.forget()
