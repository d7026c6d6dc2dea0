"""The one interface all trainers share: a per-worker loop plus save/load hooks.

The orchestrator builds one Trainer per worker process, restores it from the newest
checkpoint, and lets it run. The trainer reports each finished step to the session, which
decides (and performs) checkpoints and progress reporting; the trainer never touches storage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from orchestrator.data.datasets import Dataset
    from orchestrator.worker import WorkerSession


class Trainer(ABC):
    # False: the state is replicated (DDP, boosters) and rank 0 alone saves it.
    saves_on_all_ranks: ClassVar[bool] = False
    step_unit: ClassVar[str] = "step"  # what the progress display counts ("round" for boosting)

    def __init__(self, config: Mapping[str, Any], session: WorkerSession):
        self.config = config
        self.session = session

    # -- driver side (no worker yet) -----------------------------------------------------
    @classmethod
    @abstractmethod
    def ray_trainer_class(cls) -> type:
        """The Ray Train trainer that runs the workers (TorchTrainer, ...)."""

    @classmethod
    def ray_trainer_kwargs(cls, config: Mapping[str, Any], hang_timeout_s: float) -> dict[str, Any]:
        """Extra keyword arguments for that class (a backend config with its collective
        timeout, say: a stuck peer must not block the others for the framework's default)."""
        return {}

    @classmethod
    def controller_env(cls, hang_timeout_s: float) -> dict[str, str]:
        """Environment variables for Ray Train's controller (its backend's own timeouts)."""
        return {}

    @classmethod
    def worker_env(cls) -> dict[str, str]:
        """Environment variables the workers need before their first import."""
        return {}

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> None:
        """Raise ConfigError for input the schema cannot judge; runs before Ray starts."""
        return None

    # -- worker side ---------------------------------------------------------------------
    @abstractmethod
    def setup(self, data: Dataset) -> int:
        """Build the model for this worker; return the total number of steps."""

    @abstractmethod
    def load(self, files: Mapping[str, bytes]) -> None:
        """Restore the state written by save()."""

    @abstractmethod
    def save(self) -> dict[str, bytes]:
        """The state after the last finished step, as named files."""

    @abstractmethod
    def train(self, start_step: int) -> None:
        """Run steps start_step..total-1, calling session.step_done() after each."""

    @abstractmethod
    def evaluate(self) -> dict[str, float]:
        """Final metrics on the held-out data."""
