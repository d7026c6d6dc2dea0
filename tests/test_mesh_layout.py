"""Pipeline and tensor parallel layouts judged on the driver, on the meta device, before Ray
starts: the degrees against the worker counts, stages cut at layer names that keep the whole
model's parameter names, split points and plans that name nothing refused in one line. In
process, no Ray."""

from __future__ import annotations

import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from orchestrator.cli import CONF_DIR
from orchestrator.errors import ConfigError
from tests.test_examples import EXAMPLES
from trainers.pytorch.check import check_parts
from trainers.pytorch.mesh import cut, initialized, layer_names, stage_bounds, tensor_plan

sys.path.insert(0, str(EXAMPLES / "char_lm"))

from charlm.model import TinyGPT  # noqa: E402

LM_DATA = ["data=torch", "data.task=language_model", "data.train._target_=charlm.data.SourceBytes",
           "+data.train.split=train", "+data.train.seq_len=8",
           "data.eval._target_=charlm.data.SourceBytes", "+data.eval.split=test",
           "+data.eval.seq_len=8"]
GPT = ["trainer.model._target_=charlm.model.TinyGPT", "+trainer.model.layers=4",
       "+trainer.model.dim=32", "+trainer.model.heads=4", "+trainer.model.seq_len=8"]


def checked(*overrides: str):
    """The driver's trial of the PyTorch trainer's parts (check_parts) on a composed config."""
    from omegaconf import OmegaConf

    from orchestrator.config.typed import to_typed
    from orchestrator.driver.run_plan import complete_data
    from orchestrator.worker.training_function import size_cluster, validated
    from trainers.pytorch.config import PyTorchConfig

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        node = compose("config", overrides=list(overrides))
    size_cluster(node, set())  # the degrees against the worker counts, before typing
    complete_data(node, to_typed(node))
    cfg = OmegaConf.to_container(node, resolve=True)
    cfg["trainer"] = validated(cfg["trainer"], PyTorchConfig)  # the trainer's schema
    return check_parts(cfg)


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        checked(*overrides)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_bad_layouts_are_one_line_naming_the_key_before_ray_starts():
    assert refused("trainer.pipeline.degree=2", "cluster.workers=3") == (
        "cluster.workers=3 is not allowed: a multiple of trainer.pipeline.degree=2 x "
        "trainer.tensor.degree=1 (2): the workers are laid out as stages x tensor shards x "
        "data-parallel replicas")
    assert refused("trainer.pipeline.degree=2", "trainer.tensor.degree=2", "cluster.workers=8",
                   "cluster.min_workers=6").startswith("cluster.min_workers=6 is not allowed")
    # The default MLP (an nn.Sequential of 5 layers: Linear, ReLU, Linear, ReLU, Linear)
    assert refused("trainer.pipeline.degree=2", "cluster.workers=4",
                   "trainer.pipeline.split_at=[9]").startswith(
        "trainer.pipeline.split_at: '9' is not a layer of the model's chain (0, 1, 2, 3, 4)")
    assert "need 1 split points" in refused("trainer.pipeline.degree=2", "cluster.workers=4",
                                           "trainer.pipeline.split_at=[2,4]")
    assert refused("trainer.pipeline.degree=8", "cluster.workers=8").startswith(
        "trainer.pipeline.degree=8: the model's chain has 5 layers, fewer than the stages")
    assert refused("trainer.pipeline.degree=2", "cluster.workers=4", "trainer.batch_size=60",
                   "trainer.pipeline.microbatches=4").startswith(
        "trainer.pipeline.microbatches=4 does not divide each replica's batch: "
        "trainer.batch_size=60 over 2 data-parallel replicas (cluster.workers=4 / 2) is 30 rows")
    assert refused("trainer.pipeline.degree=2", "cluster.workers=2",
                   "trainer.pipeline.schedule=interleaved_1f1b").startswith(
        "trainer.pipeline.schedule='interleaved_1f1b' is not allowed with gloo")
    assert refused("trainer.tensor.degree=2", "cluster.workers=2").startswith(
        "trainer.tensor.degree>1: a MLP has no tensor_plan() method: give trainer.tensor.plan=")
    assert refused("trainer.tensor.degree=2", "cluster.workers=2",
                   "trainer.tensor.plan={x.*: colwise}") == \
        "trainer.tensor.plan: 'x.*' names no module of the model"
    assert refused(*GPT, "trainer.tensor.degree=2", "cluster.workers=2",
                   "trainer.tensor.plan={blocks.*.ln1: colwise}").startswith(
        "trainer.tensor.plan: blocks.0.ln1 is a LayerNorm; tensor parallelism splits nn.Linear")
    assert refused(*GPT, "trainer.tensor.degree=3", "cluster.workers=3").startswith(
        "trainer.tensor.degree=3: blocks.0.attn.q (colwise) has 32 outputs, not divisible by 3")
    assert refused("trainer.pipeline.degree=2", "cluster.workers=2", "trainer.precision=fp16-mixed") \
        .startswith("trainer.precision='fp16-mixed' is not allowed with pipeline")
    assert refused("trainer.pipeline.degree=2", "cluster.workers=2",
                   "trainer.pipeline.schedule=zigzag").startswith(
        "trainer.pipeline.schedule='zigzag' is not allowed: one of gpipe, 1f1b, interleaved_1f1b")
    assert refused("trainer.pipeline.degree=2", "cluster.workers=2",
                   "trainer.model._target_=torch.nn.Linear").startswith(
        "trainer.model: a Linear cannot be cut into pipeline stages: give it a pipeline_layers()")
    assert refused("trainer.pipeline.degree=2", "cluster.workers=2",
                   "trainer.step_fn._target_=torch.nn.functional.relu").startswith(
        "trainer.step_fn is not allowed with trainer.pipeline.degree>1")


def test_a_good_layout_passes_the_trial_on_the_meta_device():
    assert checked(*GPT, *LM_DATA, "trainer.pipeline.degree=2", "trainer.tensor.degree=2",
                   "cluster.workers=8",
                   "trainer.batch_size=16", "trainer.pipeline.microbatches=4") is None
    assert checked("trainer.pipeline.degree=2", "cluster.workers=4",
                   "trainer.pipeline.split_at=[2]") is None


def test_stages_keep_the_whole_models_parameter_names_and_cut_evenly_over_blocks():
    with torch.device("meta"):
        model = TinyGPT(dim=32, heads=4, layers=4, seq_len=8)
    names = layer_names(model)
    assert names == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln", "head"]
    # Evenly over the 4 blocks: the embedding with the first two, the head with the last two
    assert stage_bounds(model, names, 2, []) == [0, 3]
    first, second = (cut(model, {"pipeline": {}}, i, 2) for i in range(2))
    whole = {n for n, _ in model.named_parameters()}
    one, two = ({n for n, _ in s.named_parameters()} for s in (first, second))
    assert one | two == whole and not one & two
    assert "blocks.1.attn.q.weight" in one and "head.weight" in two
    assert all(p.is_meta for p in first.parameters())  # nothing allocated on a stage's cut


def test_a_tied_or_outside_parameter_cannot_be_cut():
    class Tied(nn.Sequential):
        def __init__(self):
            embed, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
            head.weight = embed.weight
            super().__init__(embed, head)

    with torch.device("meta"), pytest.raises(ConfigError, match="tied weights"):
        cut(Tied(), {"pipeline": {}}, 0, 2)


def test_the_initial_weights_do_not_depend_on_the_layout():
    """Each layer from a seed of its own: the whole model built at once equals its stages."""
    build = lambda: TinyGPT(dim=32, heads=4, layers=4, seq_len=8)  # noqa: E731
    whole = initialized(build, seed=7)
    from trainers.pytorch.mesh import materialize

    with torch.device("meta"):
        meta = build()
    stage = cut(meta, {"pipeline": {}}, 1, 2)
    materialize(stage, stage.layer_names, torch.device("cpu"), 7)
    mine = dict(stage.named_parameters())
    for name, p in whole.named_parameters():
        if name in mine:
            assert torch.equal(p, mine[name]), name
    assert "blocks.3.mlp.2.weight" in mine


def test_the_examples_gpt_names_its_tensor_plan():
    with torch.device("meta"):
        model = TinyGPT(dim=32, heads=4, layers=2, seq_len=8)
    plan = tensor_plan(model, {"tensor": {}})
    assert plan["blocks.1.attn.q"] == "colwise" and plan["blocks.0.mlp.2"] == "rowwise"
    assert len(plan) == 12
