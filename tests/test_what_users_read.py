"""What a user reads, checked in-process (no Ray): a wrong import path names the part that is
missing; an integer metric prints as an integer; `--cfg job` shows the data's real keys."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from orchestrator.cli import CONF_DIR
from orchestrator.config.schema import DataConfig
from orchestrator.config.typed import to_typed
from orchestrator.errors import ConfigError
from orchestrator.observe.progress import ProgressState, metric_text, progress_line
from orchestrator.worker.training_function import check_training
from trainers.pytorch.config import NotFound, locate

DIGITS = {"name": "digits", "task": "classification", "features": 64, "outputs": 10}


@pytest.mark.parametrize("path, message", [
    ("trainers.pytorch.models.MLPP", "module 'trainers.pytorch.models' has no attribute 'MLPP'"),
    ("trainers.pytorch.modelz.MLP", "No module named 'trainers.pytorch.modelz'"),
    ("nosuchpkg.MLP", "No module named 'nosuchpkg'"),
    ("trainers.pytorch.models.MLP.build", "'trainers.pytorch.models.MLP' has no attribute 'build'"),
    ("mlp..MLP", "'mlp..MLP' is not an import path such as mypkg.models.Net"),
])
def test_an_import_path_names_the_part_that_is_missing(path, message):
    with pytest.raises(NotFound) as err:
        locate(path)
    assert str(err.value) == message


def test_an_import_path_finds_classes_functions_and_their_attributes():
    from torch.nn import functional
    from torch.optim import SGD

    from trainers.pytorch.models import MLP

    assert locate("trainers.pytorch.models.MLP") is MLP
    assert locate("torch.optim.SGD") is SGD and locate("torch.optim.SGD.step") is SGD.step
    assert locate("torch.nn.functional.mse_loss") is functional.mse_loss


def test_a_class_missing_from_its_module_is_one_line_naming_the_key():
    model = {"_target_": "trainers.pytorch.models.MLPP", "in_features": 64, "out_features": 10}
    with pytest.raises(ConfigError) as err:
        check_training({"fn": "trainers.pytorch.train:main", "model": model}, DIGITS)
    assert str(err.value) == ("trainer.model._target_='trainers.pytorch.models.MLPP': module "
                              "'trainers.pytorch.models' has no attribute 'MLPP'")


def test_every_target_is_resolved_before_anything_is_built():
    model = {"_target_": "trainers.pytorch.models.MLP", "in_features": 64, "out_features": 10}
    scheduler = {"_target_": "torch.optim.lr_scheduler.CosineAnnealingLRR", "T_max": 10}
    with pytest.raises(ConfigError, match=r"^trainer.scheduler._target_='torch.optim.lr_scheduler"
                       r".CosineAnnealingLRR': module 'torch.optim.lr_scheduler' has no attr"):
        check_training({"fn": "trainers.pytorch.train:main", "model": model,
                        "scheduler": scheduler}, DIGITS)


@pytest.mark.parametrize("value, spec, text", [
    (2.0, ".4f", "2"), (2, ".4f", "2"), (0.97771, ".4f", "0.9777"), (12345.0, ".4g", "12345"),
    (0.1386, ".4g", "0.1386"), (float("nan"), ".4f", "nan"), (3e20, ".4g", "3e+20"),
])
def test_an_integer_metric_prints_as_an_integer(value, spec, text):
    assert metric_text(value, spec) == text


def test_the_progress_line_shows_an_integer_metric_as_an_integer():
    line = progress_line(ProgressState(step=3, total=6, metrics={"world": 2.0}))
    assert line == "step 3/6 (50%) | world=2"


@pytest.mark.parametrize("option, classes, rows", [
    ("digits", 10, None), ("synthetic", 2, 10_000), ("parquet", None, None), ("torch", None, None),
])
def test_the_composed_data_config_says_what_the_dataset_is(option, classes, rows):
    extra = {"parquet": ["data.path=/some/file.parquet"],
             "torch": ["data.train._target_=a.B", "data.eval._target_=a.B"]}.get(option, [])
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        node = compose("config", overrides=[f"data={option}", *extra])
    assert (node.data.classes, node.data.rows) == (classes, rows)  # what --cfg job prints
    to_typed(node)


def test_data_defaults_hold_when_built_in_python():
    synthetic = DataConfig(name="synthetic", features=3)
    assert (synthetic.classes, synthetic.rows) == (2, 10_000)
