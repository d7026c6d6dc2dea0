"""What a command decides about its input, decided once.

The CLI checks every config a command will run before Hydra starts it (preflight.py), and
the run's launch needs the same answers: the training function's check (a forward/backward
of the user's parts) and the data's (parquet opened, its values counted, its shape read).
Both see the same keys (paths made absolute alike), so within one command (`one_command()`,
opened by the CLI) each answer is kept, keyed by the keys it was computed from. Outside a
command (a library call, a test) nothing is kept. A check that failed is not an answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

_answers: dict[str, Any] | None = None
_parts_tried = False  # by the command that started this process (a sweep's driver)


@contextmanager
def one_command() -> Iterator[None]:
    global _answers
    _answers = {}
    try:
        yield
    finally:
        _answers = None


def decided_once(kind: str, keys: Any, decide: Callable[[], T]) -> T:
    """decide()'s answer for these keys (JSON-serialisable): within a command, computed the
    first time only."""
    if _answers is None:
        return decide()
    key = kind + ":" + json.dumps(keys, sort_keys=True, default=str)
    if key not in _answers:
        _answers[key] = decide()
    return _answers[key]


@contextmanager
def parts_tried_by_the_sweep() -> Iterator[None]:
    """A sweep's trial: the sweep's driver checked every trial's config before the first one
    started (preflight.check_command_line), its trial of the user's parts included, so the
    trial does not try them again (a forward/backward, and the framework's start-up, on every
    trial). Its config is still checked against the schema."""
    global _parts_tried
    _parts_tried = True
    try:
        yield
    finally:
        _parts_tried = False


def parts_tried() -> bool:
    return _parts_tried
