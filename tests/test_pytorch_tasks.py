"""The PyTorch trainer's tasks in-process, no Ray: every combination of {built-in loss, a step
function returning the loss, one returning (loss, metrics)} x {classification, regression,
language_model} x {tuple items, dict items} passes the driver's trial, and the workers' own
evaluation of it reduces to finite metrics, named as the trial said, as are the training
step's (the user's package: tests/user_project/mypkg/tasks.py)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from orchestrator.config.schema import DataConfig
from orchestrator.errors import ConfigError
from orchestrator.worker.training_function import check_training
from trainers.pytorch.check import trial
from trainers.pytorch.loop import Evaluation
from trainers.pytorch.parts import build_model, build_optimizer, build_step, metric_names
from trainers.pytorch.precision import Precision
from trainers.pytorch.tasks import DEFAULT_METRICS, MetricSums

TASKS = ("classification", "regression", "language_model")
STEPS = {"built-in loss": None, "step_fn -> loss": False, "step_fn -> (loss, metrics)": True}
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def user_package(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "user_project"))


def job(task: str, form: str, with_metrics: bool | None) -> tuple[dict, dict]:
    trainer = {"fn": "trainers.pytorch.train:main", "batch_size": 8,
               "model": {"_target_": "mypkg.tasks.Net", "task": task}}
    if with_metrics is not None:
        trainer["step_fn"] = {"_target_": "mypkg.tasks.step", "task": task,
                              "with_metrics": with_metrics}
    items = {"_target_": "mypkg.tasks.Items", "task": task, "form": form}
    data = DataConfig(name="torch", task=task, train=items, eval={**items, "seed": 1, "size": 13})
    return trainer, dataclasses.asdict(data)


def expected_metrics(task: str, with_metrics: bool | None) -> set[str]:
    if with_metrics is None:  # the built-in step: the task's metrics, from output and target
        return {f"test_{name}" for name in DEFAULT_METRICS[task]}
    own = {"test_mae" if task == "regression" else "test_accuracy"} if with_metrics else set()
    return {"test_loss", *(["test_perplexity"] if task == "language_model" else []), *own}


@pytest.mark.parametrize("form", ["tuple", "dict"])
@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("kind", STEPS)
def test_every_task_and_step_passes_the_trial_and_evaluates_to_finite_metrics(kind, task, form):
    from mypkg.tasks import Items

    trainer, data = job(task, form, STEPS[kind])
    training = check_training(trainer, data)  # the driver's checks, the trial among them
    cfg = training.config
    names = trial({"trainer": cfg, "data": data})
    own = {"mae" if task == "regression" else "accuracy"} if STEPS[kind] else set()
    assert set(names) == expected_metrics(task, STEPS[kind]) | {"loss", *own}

    # A short run, then the workers' evaluation (one rank) of the held-out items.
    torch.manual_seed(0)
    model, step = build_model(cfg), build_step(cfg, task)
    optimizer = build_optimizer(cfg, model.parameters())
    train_set = Items(task, form)
    for start in range(0, 24, 8):
        loss, reported = step(model, default_collate([train_set[i] for i in range(start, start + 8)]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    evaluate = Evaluation(SimpleNamespace(rank=0, world_size=1, seed=0), model, step,
                          Items(task, form, size=13, seed=1), default_collate,
                          metric_names(cfg, task), Precision("32", CPU), 5, 0, CPU)
    metrics = evaluate()
    assert set(metrics) == {n for n in names if n.startswith("test_")}, metrics
    assert {"loss", *reported} == set(names) - set(metrics)  # what the loop's steps report
    assert all(math.isfinite(value) for value in metrics.values()), metrics


def test_a_step_functions_metrics_reduce_without_the_outputs_sums():
    """The reported crash: regression's mse and r2 need sums a step function does not give
    (KeyError: 'sse'); they are left out, its own metric comes through."""
    sums = MetricSums("regression", DEFAULT_METRICS["regression"], CPU)
    sums.add_means(torch.tensor(4.0), {"mae": torch.tensor(1.5)}, count=3)
    sums.add_means(torch.tensor(1.0), {"mae": 0.5}, count=1)
    assert sums.reduce(None) == {"test_loss": 3.25, "test_mae": 1.25}
    assert MetricSums("regression", ["mse"], CPU).reduce(None) == {}  # no held-out rows


def test_metrics_a_step_function_cannot_give_are_refused_by_the_trial():
    trainer, data = job("regression", "dict", with_metrics=True)
    with pytest.raises(ConfigError, match=r"^trainer.metrics: r2 cannot be computed: "
                       r"trainer.step_fn gives the loss and its own metrics \(mae\)"):
        check_training({**trainer, "metrics": ["loss", "r2"]}, data)


def test_a_metric_that_is_not_one_number_is_named_by_the_trial(monkeypatch):
    import mypkg.tasks

    step = mypkg.tasks.step

    def vector_metric(model, batch, task, with_metrics=False):
        return step(model, batch, task), {"mae": torch.ones(2)}

    monkeypatch.setattr(mypkg.tasks, "step", vector_metric, raising=True)
    trainer, data = job("regression", "tuple", with_metrics=True)
    with pytest.raises(ConfigError, match=r"^trainer.step_fn: in evaluation: ValueError: its "
                       r"metric 'mae' is \(2,\), not one number"):
        check_training(trainer, data)


def test_a_model_with_fewer_outputs_than_classes_is_named_before_ray_and_not_retried():
    from trainers.pytorch.parts import ClassBeyondOutputs

    trainer, data = job("classification", "tuple", with_metrics=None)
    narrow = {"_target_": "torch.nn.Linear", "in_features": 4, "out_features": 2}
    # Items 0 and 1 are classes 2 and 0: the driver's trial meets class 2.
    with pytest.raises(ConfigError, match=r"^trainer.model: the model gives 2 outputs a row, but "
                       r"a target in this batch is class 2: trainer.model needs one output per "
                       r"class \(at least 3\) \(Target 2 is out of bounds.\)$"):
        check_training({**trainer, "model": narrow}, data)
    # A class the trial's two items lack, met by a worker: said as plainly, and not retried.
    step = build_step({"loss": None, "step_fn": None}, "classification")
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ClassBeyondOutputs, match=r"gives 2 outputs a row, but a target in this "
                       r"batch is class 5") as err:
        step(model, (torch.zeros(3, 4), torch.tensor([0, 5, 1])))
    assert err.value.retry is False


def test_a_scheduler_stepped_with_a_metric_is_refused_by_the_trial():
    trainer, data = job("classification", "tuple", with_metrics=None)
    plateau = {"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau"}
    with pytest.raises(ConfigError, match=r"^trainer.scheduler: ReduceLROnPlateau.step\(\) needs "
                       r"metrics, but the run steps its scheduler after every optimizer step with "
                       r"no argument"):
        check_training({**trainer, "scheduler": plateau}, data)
    steps = {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 5}
    check_training({**trainer, "scheduler": steps}, data)  # a schedule of steps passes


def test_what_the_default_step_would_do_silently_with_the_items_is_said(caplog):
    trainer, data = job("classification", "weighted", with_metrics=None)
    with caplog.at_level("WARNING", logger="trainers.pytorch.check"):
        check_training({**trainer, "batch_size": 64}, data)
    said = [r.getMessage() for r in caplog.records if r.name == "trainers.pytorch.check"]
    assert said == [
        "data.train holds 24 items, fewer than one global batch (trainer.batch_size=64): every "
        "step trains on all 24",
        "data.train's items have 3 parts: the default step takes the first as the inputs and "
        "the second as the target, and ignores the rest (a sample weight too); give "
        "trainer.step_fn to use them"]
    caplog.clear()
    trainer, data = job("classification", "tuple", with_metrics=None)
    with caplog.at_level("WARNING", logger="trainers.pytorch.check"):
        check_training(trainer, data)  # 24 items, batches of 8, (x, y): nothing to say
    assert not [r for r in caplog.records if r.name == "trainers.pytorch.check"]


def test_held_out_metrics_read_binary_outputs_padding_tokens_and_several_targets():
    from trainers.pytorch.parts import build_step

    # One logit a row (BCEWithLogitsLoss): class 1 above 0; a probability (BCELoss): above 0.5.
    target = torch.tensor([0.0, 1.0, 1.0, 0.0])
    for loss, output in [("torch.nn.BCEWithLogitsLoss", torch.tensor([[-3.0], [2.0], [4.0], [-1.0]])),
                         ("torch.nn.BCELoss", torch.tensor([[0.1], [0.9], [0.7], [0.2]]))]:
        step = build_step({"loss": {"_target_": loss}, "step_fn": None}, "classification")
        sums = MetricSums("classification", ["accuracy"], CPU)
        sums.add(output, target, step.loss_fn(output.squeeze(-1), target), 1.0, step.threshold)
        assert sums.reduce(None) == {"test_accuracy": 1.0}, loss

    # Language model: labels -100 (padding) are no tokens: not in the loss's mean, not in accuracy.
    logits = torch.full((1, 4, 3), -9.0)
    logits[0, torch.arange(4), torch.tensor([2, 1, 0, 0])] = 9.0
    labels = torch.tensor([[2, 1, -100, -100]])
    sums = MetricSums("language_model", ["accuracy", "loss"], CPU)
    sums.add(logits, labels, F.cross_entropy(logits.reshape(-1, 3), labels.reshape(-1)))
    padding_only = torch.full((1, 4), -100)
    sums.add(logits, padding_only, F.cross_entropy(logits.reshape(-1, 3), padding_only.reshape(-1)))
    metrics = sums.reduce(None)
    assert metrics["test_accuracy"] == 1.0 and metrics["test_loss"] < 1e-6, metrics
    # A rank whose batches hold padding only keeps the same sums (stacked by key for one
    # all-reduce with the other ranks').
    alone = MetricSums("language_model", ["accuracy", "loss"], CPU)
    alone.add(logits, padding_only, F.cross_entropy(logits.reshape(-1, 3), padding_only.reshape(-1)))
    assert set(alone.sums) == set(sums.sums)

    # Regression with two targets a row: mse over every value, r2 the columns' mean.
    y = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0]])
    out = y + torch.tensor([[0.5, -1.0], [-0.5, 1.0], [0.5, -1.0], [-0.5, 1.0]])
    sums = MetricSums("regression", ["mse", "r2"], CPU)
    sums.add(out, y, F.mse_loss(out, y))
    metrics = sums.reduce(None)
    assert metrics["test_mse"] == pytest.approx(F.mse_loss(out, y).item())
    r2 = [1 - ((out[:, j] - y[:, j]) ** 2).sum() / ((y[:, j] - y[:, j].mean()) ** 2).sum() for j in (0, 1)]
    assert metrics["test_r2"] == pytest.approx(float(sum(r2) / 2))


def test_the_trial_runs_two_held_out_items_through_the_evaluation_step():
    """A held-out set the model cannot take failed after the last training step."""
    trainer, data = job("classification", "tuple", with_metrics=None)
    data["eval"] = {"_target_": "mypkg.bad_parts.DoubleItems"}
    with pytest.raises(ConfigError, match=r"^data.eval: items 0 and 1 through the evaluation "
                       r"step: RuntimeError: mat1 and mat2 must have the same dtype"):
        check_training(trainer, data)


def test_a_model_output_object_is_evaluated_by_its_logits():
    trainer, data = job("classification", "tuple", with_metrics=None)
    trainer = {**trainer, "model": {"_target_": "mypkg.tasks.OutputNet", "task": "classification"},
               "loss": {"_target_": "mypkg.tasks.output_loss"}}
    names = trial({"trainer": check_training(trainer, data).config, "data": data})
    assert set(names) == {"test_accuracy", "test_loss", "loss"}

    from mypkg.tasks import Items, Output, OutputNet

    from trainers.pytorch.parts import build_step

    step = build_step({"loss": trainer["loss"], "step_fn": None}, "classification")
    batch = default_collate([Items("classification")[i] for i in range(8)])
    sums = MetricSums("classification", ["accuracy", "loss"], CPU)
    step.measure(OutputNet("classification"), batch, sums)
    assert set(sums.reduce(None)) == {"test_accuracy", "test_loss"}
    with pytest.raises(TypeError, match=r"the model's output is a Output, not a tensor"):
        MetricSums("classification", ["accuracy"], CPU).add(Output(None), batch[1], torch.tensor(1.0))
