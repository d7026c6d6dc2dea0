"""The driver's trial of the user's parts without importing torch._dynamo.

torch.optim imports torch._dynamo (about a CPU-second, the largest part of the trial) only
to mark its methods as not to be compiled: an optimizer's constructor (``add_param_group``)
and every ``step`` import it and call ``torch._dynamo.disable`` and ``graph_break``. The
trial never compiles, and it stands on the path from the command to the first step. So,
for the trial alone, a stand-in module takes torch._dynamo's place: its ``disable`` marks
nothing and its ``graph_break`` does nothing (as the real one does outside compiled code).
Anything else asked of it (a user's ``torch.compile``, their ``torch._dynamo.config``) loads
the real module, which takes over. The workers, which may compile, never see it.

torch's internals in one place: tests/test_pytorch_internals.py checks that the trial of
the default job imports no torch._dynamo, and that a part compiled by the user still works.
"""

from __future__ import annotations

import importlib
import sys
import types
from contextlib import contextmanager

NAME = "torch._dynamo"


class _StandIn(types.ModuleType):
    """torch._dynamo as torch.optim uses it outside compiled code."""

    def __init__(self) -> None:
        super().__init__(NAME)
        self._marked: list = []  # functions torch cached our (no-op) disable on
        self._real = None

    def disable(self, fn=None, recursive=True, **kwargs):
        if self._real is not None:
            return self._real.disable(fn, recursive, **kwargs)
        if fn is not None:
            self._marked.append(fn)
            return fn
        return lambda f: self.disable(f, recursive, **kwargs)

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
        return self._real

    def forget(self) -> None:
        """Leave the process as if this module had never been there."""
        if sys.modules.get(NAME) is self:
            del sys.modules[NAME]
        torch = sys.modules.get("torch")
        if torch is not None and torch.__dict__.get("_dynamo") is self:
            delattr(torch, "_dynamo")
        for fn in self._marked:  # torch.optim's methods cache what disable gave them
            if getattr(fn, "__dynamo_disable", None) is fn:
                delattr(fn, "__dynamo_disable")
        self._marked.clear()


@contextmanager
def without_dynamo():
    """Run the block with the stand-in, where torch._dynamo is not imported yet. Yields
    whether it stood in: a block that fails with it is worth running once more without it
    (a part that imports a torch._dynamo submodule fails on the stand-in, not on the real
    module)."""
    if NAME in sys.modules:
        yield False
        return
    stand_in = _StandIn()
    sys.modules[NAME] = stand_in
    try:
        yield True
    finally:
        stand_in.forget()
