"""The PyTorch trainer's loop in this process, one rank, no Ray: what its update and its held-out
metrics are, against the same computed by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainers.pytorch.loop as loop
from orchestrator.data.order import DataOrder, step_seed
from orchestrator.worker_api import Batches


@pytest.fixture(autouse=True)
def one_cpu_rank(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "user_project"))
    monkeypatch.setattr(loop.ray.train.torch, "get_device", lambda: torch.device("cpu"))


class OneRank:
    """What the loop asks of its worker context, for rank 0 of 1."""

    seed, rank, world_size, start_step, streamed, total_steps = 0, 0, 1, 0, False, None

    def __init__(self):
        self.reports, self.evaluations = [], []

    def restore(self, files=None):
        return None

    def batches(self, num_rows, global_batch):
        return Batches(DataOrder(self.seed, num_rows, global_batch), self.rank, self.world_size)

    def step_seed(self, step):
        return step_seed(self.seed, step, self.rank)

    def step_done(self, step, metrics, samples=0):
        self.reports.append((step, samples, {k: float(v) for k, v in metrics.items()}))

    def should_evaluate(self, step):
        return step == self.total_steps

    def eval_done(self, step, metrics):
        self.evaluations.append(metrics)

    def should_save(self, step):
        return False

    def should_preempt(self):
        return False


def trainer(**keys) -> dict:
    return {"name": "ddp", "parallel": "ddp", "backend": "torch",
            "model": {"_target_": "torch.nn.Linear", "in_features": 4, "out_features": 3},
            "loss": {"_target_": None}, "step_fn": {"_target_": None},
            "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 1.0},
            "scheduler": {"_target_": None}, "metrics": None, "batch_size": 8,
            "micro_batch_size": None, "precision": "32", "grad_clip": None,
            "allow_nonfinite_loss": False, "epochs": 1, "max_steps": None,
            "release_host_memory": None, "fsdp": {}, **keys}


def items(task="classification", size=24, **keys) -> dict:
    node = {"_target_": "mypkg.tasks.Items", "task": task, "size": size, **keys}
    return {"name": "torch", "task": task, "train": node, "eval": {**node, "seed": 1},
            "collate_fn": {"_target_": None}, "num_workers": 0}


def trained(monkeypatch, cfg: dict) -> tuple[torch.nn.Module, torch.nn.Module, OneRank]:
    """The model the loop trained, a copy of it before, and what it reported."""
    import copy

    built = {}
    build = loop.build_model

    def keep(tcfg):
        built["model"] = build(tcfg)
        built["before"] = copy.deepcopy(built["model"])
        return built["model"]

    monkeypatch.setattr(loop, "build_model", keep)
    ctx = OneRank()
    loop.main(ctx, cfg)
    return built["model"], built["before"], ctx


def test_data_smaller_than_one_global_batch_steps_by_the_mean_gradient_of_its_rows(monkeypatch):
    from mypkg.tasks import Items

    model, before, ctx = trained(monkeypatch, {"trainer": trainer(batch_size=64, max_steps=1),
                                               "data": items(size=24)})
    data = Items("classification", size=24)
    torch.nn.functional.cross_entropy(before(data.x), data.y).backward()
    # SGD, lr 1: the update is minus the mean gradient over the 24 rows, not 24/64 of it
    assert torch.allclose(model.weight - before.weight, -before.weight.grad, atol=1e-6)
    assert ctx.reports[0][1] == 24  # samples the step trained on


def test_a_batch_object_of_the_users_reaches_the_device_and_weighs_its_items(monkeypatch):
    """A collate function's own batch (a dataclass here; a tokenizer's BatchEncoding is a
    UserDict) is moved whole, and its held-out metrics weigh the items it holds."""
    from collections import UserDict, namedtuple

    from mypkg.tasks import Batch

    from trainers.pytorch.data import to_device

    meta = torch.device("meta")
    pair = namedtuple("Pair", "x y")
    for batch in (Batch(torch.ones(2), torch.ones(2)), UserDict(x=torch.ones(2), y=torch.ones(2)),
                  pair(torch.ones(2), torch.ones(2)), {"x": [torch.ones(2)], "y": torch.ones(2)}):
        moved = to_device(batch, meta)
        assert type(moved) is type(batch)
        values = [moved.x, moved.y] if hasattr(moved, "x") else [moved["x"], moved["y"]]
        assert all(t.device == meta for v in values for t in (v if isinstance(v, list) else [v]))

    cfg = {"trainer": trainer(batch_size=8, max_steps=6, step_fn={"_target_": "mypkg.tasks.batch_step"}),
           "data": {**items(size=24), "collate_fn": {"_target_": "mypkg.tasks.collate_as_batch"}}}
    _, _, ctx = trained(monkeypatch, cfg)
    held_out = ctx.evaluations[-1]
    assert held_out["test_loss"] > 0 and 0 < held_out["test_accuracy"] <= 1, held_out


def test_a_parameter_without_gradient_and_a_model_method_under_ddp_are_said_plainly(monkeypatch):
    """Both pass a run on one worker and fail DDP's on two: a parameter the step leaves without
    a gradient at its second step, a step function calling model.loss at its first."""
    import torch.distributed as dist

    from orchestrator.errors import ConfigError
    from tests.conftest import free_port
    from trainers.pytorch.check import trial
    from trainers.pytorch.parallel import parallelize
    from trainers.pytorch.parts import StepCallsAModelMethod, build_step

    cfg = {"trainer": trainer(model={"_target_": "mypkg.bad_parts.UnusedHead"}), "data": items()}
    with pytest.raises(ConfigError, match=r"^trainer.model: the training step leaves 2 parameters "
                       r"without a gradient \(aux.weight, aux.bias\), which stops DDP on 2 or more "
                       r"workers: set trainer.find_unused_parameters=true"):
        trial(cfg)
    trial({**cfg, "trainer": {**cfg["trainer"], "find_unused_parameters": True}})

    from mypkg.bad_parts import UnusedHead

    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        for find in (False, True):  # DDP as a run of 2 workers wraps it
            model = parallelize(UnusedHead(), {"parallel": "ddp", "find_unused_parameters": find},
                                2, torch.device("cpu"))
            steps = 0
            try:
                for _ in range(2):
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    steps += 1
            except RuntimeError as exc:
                assert "Expected to have finished reduction" in str(exc)
            assert steps == (2 if find else 1)
        step = build_step({"loss": None, "step_fn": {"_target_": "mypkg.bad_parts.method_step"}},
                          "classification")
        with pytest.raises(StepCallsAModelMethod, match="call model") as err:
            step(parallelize(UnusedHead(), {"parallel": "ddp"}, 2, torch.device("cpu")), (x, y))
        assert err.value.retry is False
    finally:
        dist.destroy_process_group()


def test_a_ranks_held_out_batch_is_no_larger_than_its_training_forward():
    from trainers.pytorch.loop import eval_batch_size

    assert eval_batch_size({"batch_size": 64, "micro_batch_size": None}, 4) == 16
    assert eval_batch_size({"batch_size": 64, "micro_batch_size": 8}, 2) == 8
    assert eval_batch_size({"batch_size": 10, "micro_batch_size": None}, 3) == 4
