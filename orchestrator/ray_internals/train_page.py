"""The dashboard's Train page without torch in the controller's process.

Ray Train's state callback (what fills the page) asks rank 0 which framework versions it runs,
and torch's `__version__` is a `str` subclass (torch.torch_version.TorchVersion) that pickles as
that class: unpickling the answer imported torch in the controller, which torch_backend.py
otherwise keeps out of it. That import sat on every run's path to its first step: the state
callback took 2.6-3.3 s of the worker group's start against 1 ms for rank 0's answer (Ray's
timeline and its callback timings, a joined head, 2026-11-30). Here rank 0 answers in plain
strings; the page shows the same versions.

tests/test_ray_internals.py checks what this takes from Ray against the installed Ray.
"""

from __future__ import annotations

from ray.train.v2._internal.callbacks import state_manager
from ray.train.v2._internal.callbacks.state_manager import StateManagerCallback

_rays_versions = state_manager._get_framework_version


def plain_framework_versions(framework) -> dict[str, str]:
    """On rank 0: Ray's answer, each version a plain string."""
    return {name: str(version) for name, version in _rays_versions(framework).items()}


class PlainVersionsStateManager(StateManagerCallback):
    """Ray Train's state callback, whose question to rank 0 is answered in plain strings."""

    @classmethod
    def of(cls, callback: StateManagerCallback) -> PlainVersionsStateManager:
        plain = cls.__new__(cls)
        plain.__dict__.update(callback.__dict__)
        return plain

    def after_worker_group_start(self, worker_group) -> None:
        # Ray's callback asks through its module's name for the function; this runs in the
        # controller's process, which runs nothing else of the module.
        state_manager._get_framework_version = plain_framework_versions
        super().after_worker_group_start(worker_group)
