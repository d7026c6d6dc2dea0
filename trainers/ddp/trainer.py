"""PyTorch DDP behind the Trainer interface.

Exactness: the global batch at a step is fixed by (seed, step) whatever the world size, the
loss is scaled so that DDP's gradient average equals the mean over the global batch, and
per-step randomness is seeded from (seed, step, rank); so a resumed run replays the same
computation as one that never stopped.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import ray.train.torch
import torch
import torch.nn.functional as F
from hydra.utils import instantiate

from orchestrator.data.order import step_seed
from orchestrator.trainer_api import Trainer
from trainers.neural import check_model_target, standardize, total_steps


def to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


class DDPTrainer(Trainer):
    @classmethod
    def ray_trainer_class(cls) -> type:
        return ray.train.torch.TorchTrainer

    @classmethod
    def ray_trainer_kwargs(cls, config: Mapping[str, Any], hang_timeout_s: float) -> dict[str, Any]:
        backend = config.get("backend", "auto")
        # None lets Ray pick nccl with GPUs and gloo on CPU.
        torch_config = ray.train.torch.TorchConfig(
            backend=None if backend == "auto" else backend, timeout_s=int(hang_timeout_s))
        return {"torch_config": torch_config}

    @classmethod
    def controller_env(cls, hang_timeout_s: float) -> dict[str, str]:
        # Replacing a worker group first asks every worker to leave the process group and
        # waits up to 30 s (Ray's default) for all of them: a hung worker never answers, and
        # the workers are killed right after anyway. Healthy ones leave in milliseconds.
        return {"TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S": "2"}

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> None:
        check_model_target(config)

    # -- worker side ---------------------------------------------------------------------
    def setup(self, data) -> int:
        cfg, s = self.config, self.session
        torch.manual_seed(s.seed)  # the same initial weights on every rank and every attempt
        self.module = instantiate(dict(cfg["model"]), in_features=data.num_features,
                                  num_classes=data.num_classes, _convert_="all")
        x_train, x_test = standardize(data.x_train, data.x_test)
        self.x_train, self.x_test = torch.from_numpy(x_train), torch.from_numpy(x_test)
        self.y_train, self.y_test = torch.from_numpy(data.y_train), torch.from_numpy(data.y_test)
        self.model = ray.train.torch.prepare_model(self.module)
        self.device = next(self.module.parameters()).device
        self.optimizer = self._optimizer()
        self.batch_size = int(cfg["batch_size"])
        self.order = s.data_order(len(self.y_train), self.batch_size)
        return total_steps(cfg, self.order.steps_per_epoch)

    def _optimizer(self) -> torch.optim.Optimizer:
        cfg, params = self.config, self.module.parameters()
        name, lr, wd = cfg["optimizer"], float(cfg["lr"]), float(cfg["weight_decay"])
        if name == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=float(cfg["momentum"]), weight_decay=wd)
        if name == "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=wd)
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd)

    def save(self) -> dict[str, bytes]:
        return {"model.pt": to_bytes(self.module.state_dict()),
                "optimizer.pt": to_bytes(self.optimizer.state_dict())}

    def load(self, files: Mapping[str, bytes]) -> None:
        self.module.load_state_dict(from_bytes(files["model.pt"]))
        self.optimizer.load_state_dict(from_bytes(files["optimizer.pt"]))

    def train(self, start_step: int) -> None:
        s, world = self.session, self.session.world_size
        self.model.train()
        for step in range(start_step, s.total_steps):
            rows = torch.from_numpy(self.order.shard(step, s.rank, world))
            x, y = self.x_train[rows].to(self.device), self.y_train[rows].to(self.device)
            self._seed_step(step_seed(s.seed, step, s.rank))
            loss_sum = F.cross_entropy(self.model(x), y, reduction="sum")
            # DDP averages gradients over ranks; scaled so, the result is the mean over the
            # global batch even when ranks hold different numbers of rows.
            loss = loss_sum * (world / self.batch_size)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            local_mean = loss_sum.item() / max(1, len(rows))
            s.step_done(step + 1, {"loss": local_mean}, samples=self.batch_size)

    def _seed_step(self, seed: int) -> None:
        """What torch.manual_seed does for the devices in use, without its cost: on a CPU-only
        machine it also queues lazy seeding calls for CUDA, XPU and MTIA, each formatting a
        stack trace (~0.1-0.5 ms a step, 3% of a small model's step time)."""
        torch.random.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        training = self.module.training  # also called between steps (run.eval_every_steps)
        self.module.eval()
        logits = self.module(self.x_test.to(self.device))
        self.module.train(training)
        y = self.y_test.to(self.device)
        return {
            "test_accuracy": float((logits.argmax(1) == y).float().mean()),
            "test_loss": float(F.cross_entropy(logits, y)),
        }



