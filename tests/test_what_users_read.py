"""What a user reads, checked in-process (no Ray): a wrong import path names the part that is
missing; an integer metric prints as an integer; `--cfg job` shows the data's real keys; every
measured figure README.md and docs/ quote is the one in docs/figures.json."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from orchestrator.cli import CONF_DIR
from orchestrator.config.schema import DataConfig
from orchestrator.config.typed import to_typed
from orchestrator.errors import ConfigError
from orchestrator.observe.progress import ProgressState, metric_text, progress_line
from orchestrator.worker.training_function import check_training
from scripts import readme_figures
from tests.conftest import REPO
from trainers.pytorch.config import NotFound, locate

FIGURES = readme_figures.load()  # as committed
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


def test_every_figure_the_pages_quote_is_the_measured_one():
    figures = readme_figures.load()
    texts = {page.name: page.read_text() for page in readme_figures.pages()}
    for name, text in texts.items():
        assert readme_figures.mismatches(text, figures) == [], name
        assert readme_figures.misplaced(text) == [], name
    assert readme_figures.unquoted(list(texts.values()), figures) == []


def test_a_figure_edited_by_hand_is_named():
    readme = (REPO / "README.md").read_text()
    quote = next(q for q in readme_figures.quotes(readme) if q.key == "image_cnn.test_accuracy")
    edited = readme[:quote.start] + "0.123" + readme[quote.end:]
    assert readme_figures.mismatches(edited, FIGURES) == [
        {"figure": "image_cnn.test_accuracy", "shown": "0.123", "measured": quote.shown}]


def test_the_pages_are_rewritten_from_new_figures_and_nothing_else_changes():
    measured = copy.deepcopy(FIGURES)
    measured["default"].update(steps=221, wall_s=25.04)
    measured["default"]["metrics"].update(test_accuracy=0.98611, test_loss=0.07)
    measured["image_cnn"]["metrics"]["test_accuracy"] = 0.98123
    measured["char_lm"]["steps"] = 400
    readme = (REPO / "README.md").read_text()
    new = readme_figures.rewrite(readme, measured)
    assert ("succeeded in 25.0s at step 221: test_accuracy=0.9861 test_loss=0.0700\n" in new
            and "<!-- fig:image_cnn.test_accuracy -->0.981<!-- /fig -->" in new
            and "<!-- fig:char_lm.steps -->400<!-- /fig -->" in new)
    assert readme_figures.mismatches(new, measured) == []
    assert readme_figures.rewrite(new, FIGURES) == readme  # only the figures changed


def test_a_line_template_that_matches_no_line_of_its_block_is_refused():
    text = "<!-- fig-line: at step {default.steps}: -->\n```\nsucceeded at step 220\n```\n"
    with pytest.raises(ValueError, match="matches 0 lines of the block after it"):
        readme_figures.quotes(text)


def test_an_example_runs_from_its_own_folder_with_its_own_run_folder_and_storage(
        monkeypatch, tmp_path):
    ran = []

    def run(cmd, cwd, **_):  # what the command would leave: its run.json
        ran.append((cmd, cwd))
        run_dir = Path(next(a for a in cmd if a.startswith("hydra.run.dir=")).partition("=")[2])
        run_dir.mkdir(parents=True)
        (run_dir / "run.json").write_text(json.dumps({
            "status": "succeeded", "steps": 176, "wall_s": 40.2,
            "metrics": {"test_accuracy": 0.98, "test_loss": 0.1}}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(readme_figures.subprocess, "run", run)
    entry = readme_figures.measure("image_cnn", "127.0.0.1:6379", tmp_path)
    [(cmd, cwd)] = ran
    assert cwd == REPO / "examples" / "image_cnn"
    assert cmd[1:] == ["-m", "orchestrator", "-cd", "conf", "+experiment=cnn", "cluster.workers=2",
                       f"hydra.run.dir={tmp_path / 'image_cnn' / 'run'}",
                       f"storage.uri={tmp_path / 'image_cnn' / 'ckpt'}",
                       "cluster.address=127.0.0.1:6379"]
    assert entry["command"] == "python -m orchestrator -cd conf +experiment=cnn cluster.workers=2"
    assert (entry["steps"], entry["metrics"]) == (176, {"test_accuracy": 0.98})  # what pages quote
