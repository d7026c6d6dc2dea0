"""The driver's trial of the user's parts without importing torch._dynamo where nothing
compiles. Never in a worker: where training runs, user code meets torch's own module.

torch.optim imports torch._dynamo (about a CPU-second a process: the largest part of the
trial beside torch itself) only to mark its methods as not to be compiled: an optimizer's
constructor (``add_param_group``) and every ``step`` call torch's lazy ``_disable_dynamo``
(``torch._dynamo.disable(fn, recursive, wrapping=False)``, cached on the function) and
``graph_break``. Without compiling, neither changes what runs, so a stand-in module takes
torch._dynamo's place for the trial: for torch's lazy marks its ``disable`` gives back a mark
that calls the function (the real module's disable of it once that is loaded), and its
``graph_break`` does nothing (as the real one does outside compiled code). Any other use (a
part that calls ``torch.compile``, sets ``torch._dynamo.config``, imports one of its
submodules; a ``torch._dynamo.disable`` of the user's own) loads the real module, which takes
over and marks what the stand-in had been asked to: from then on the process is as if the
real module had been there from the start. The trial leaves no trace of it
(``without_dynamo``).

The training workers import the real module as they start (the torch backend's warm imports,
orchestrator/driver/backends.py): it stood in there too until a user's ``torch.compile`` under DDP and FSDP
became a tested feature (tests/test_ddp_e2e.py), ~1 CPU-s more a cold worker.

torch's internals in one place: tests/test_pytorch_tasks.py checks, in fresh interpreters,
that the default parts' trial imports no torch._dynamo, that parts which compile (or import
its submodules first) pass in one trial, and that what was marked is marked by the real
module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading
import types
from contextlib import contextmanager
from importlib.machinery import ModuleSpec

NAME = "torch._dynamo"
_LOADING = threading.RLock()
MARK = "__dynamo_disable"  # where torch caches what disable gave (a string: no name mangling)


class _StandIn(types.ModuleType):
    """torch._dynamo as torch.optim and DDP use it outside compiled code."""

    def __init__(self, spec: ModuleSpec) -> None:
        super().__init__(NAME)
        self.__spec__ = spec
        self.__path__ = list(spec.submodule_search_locations or [])  # a package, to importlib
        self._marked: list[_Mark] = []  # what disable was asked for
        self._real = None

    def disable(self, fn=None, recursive=True, **kwargs):
        # torch's lazy marks alone (wrapping=False, once a function); a user's own disable
        # gets the real wrapper
        with _LOADING:
            if self._real is None and fn is not None and kwargs == {"wrapping": False}:
                mark = _Mark(self, fn, recursive)
                self._marked.append(mark)
                return mark
        return self.load_real().disable(fn, recursive, **kwargs)

    def graph_break(self, *args, **kwargs) -> None:
        if self._real is not None:
            self._real.graph_break(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__"):  # what import machinery and copy probe: not there
            raise AttributeError(name)
        return getattr(self.load_real(), name)

    def load_real(self):
        if self._real is None:
            with _LOADING:  # two threads: one takes the stand-in out of sys.modules
                if sys.modules.get(NAME) is self:
                    del sys.modules[NAME]
            # Not under the lock: the real package's imports take module locks a thread
            # waiting for it may hold (import machinery serialises the import itself)
            real = importlib.import_module(NAME)
            with _LOADING:
                if self._real is None:
                    _remove_finder()
                    self._real = real
                marks, self._marked = self._marked, []
            for mark in marks:  # torch's cache of each: the real module's disable from now on
                mark.hand_over()
        return self._real

    def forget(self) -> None:
        """Leave the process as if this module had never been there."""
        _remove_finder()
        if sys.modules.get(NAME) is self:
            del sys.modules[NAME]
        torch = sys.modules.get("torch")
        if torch is not None and torch.__dict__.get("_dynamo") is self:
            delattr(torch, "_dynamo")
        for mark in self._marked:
            if mark.fn.__dict__.get(MARK) is mark:
                delattr(mark.fn, MARK)
        self._marked.clear()


class _Mark:
    """What the stand-in's disable gives torch for one of its functions, which torch caches on
    the function (``MARK``) and calls in its place: the function itself while the real module
    is not loaded; from then on the real module's disable of it, which also replaces this in
    torch's cache, at the hand-over or, where torch cached this only after it (another thread
    loaded the real module meanwhile), at its next call."""

    def __init__(self, stand_in: _StandIn, fn, recursive: bool):
        self.stand_in, self.fn, self.recursive = stand_in, fn, recursive

    def __call__(self, *args, **kwargs):
        if self.stand_in._real is None:
            return self.fn(*args, **kwargs)
        return self.hand_over()(*args, **kwargs)

    def hand_over(self):
        """The real module's disable of the function, put in torch's cache in place of this."""
        real = self.stand_in._real.disable(self.fn, self.recursive, wrapping=False)
        if self.fn.__dict__.get(MARK) is self:
            setattr(self.fn, MARK, real)
        return real


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
