"""Pipeline and tensor parallelism on real Ray, 4 CPU workers (gloo), against single-process
runs of the same model, seed and global batch (tests/mesh_reference.py): P=2 x D=2 with GPipe
and with 1F1B, a worker SIGKILLed mid-run resuming bit for bit, a P=2 x D=2 checkpoint
resumed at P=1 x D=2; T=2 x D=2 on the char LM example."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

from tests.conftest import REPO, finish_run, start_run, user_project, wait_for
from tests.mesh_reference import char_lm, digits_mlp, model_pt_at, not_close, sharded_model_at
from tests.test_examples import EXAMPLES

pytestmark = pytest.mark.slow

STEPS = 12
PIPELINE = ["trainer.pipeline.degree=2", "cluster.workers=4", f"trainer.max_steps={STEPS}",
            "checkpoint.every_steps=6", "trainer.batch_size=64", "trainer.pipeline.microbatches=4"]


def test_a_pipeline_trains_as_one_process_does_resumes_bit_for_bit_and_at_another_degree(
        ray_head, tmp_path):
    project, storage = user_project(tmp_path), tmp_path / "ckpt"
    # Two runs side by side: 4 workers of a quarter CPU each, half the head's CPUs a run.
    cluster = [f"cluster.address={ray_head.address}", "cluster.cpus_per_worker=0.25",
               f"storage.uri={storage}"]
    straight = start_run(tmp_path / "gpipe", *cluster, *PIPELINE,
                         "trainer.pipeline.schedule=gpipe", "run.name=gpipe", cwd=project)
    # 1F1B, held at step 9 (a gate) once step 6 is committed; a worker SIGKILLed there.
    gate = tmp_path / "gate"
    gate.write_text("hold")
    killed = start_run(tmp_path / "onef", *cluster, *PIPELINE, "trainer.pipeline.schedule=1f1b",
                       "run.name=onef", "trainer.fn=tests.user_trainers:gated_ddp",
                       f"+trainer.gate={gate}", "+trainer.hold_at=9", cwd=project,
                       env={"PYTHONPATH": str(REPO)})
    try:
        rec = wait_for(lambda r: r.get("checkpoints") and len(r.get("workers", [])) == 4,
                       tmp_path / "onef")
        os.kill(rec["workers"][3]["pid"], signal.SIGKILL)  # the last stage of replica 1
        wait_for(lambda r: r.get("restarts") == 1 and len(r.get("world_sizes", [])) == 2,
                 tmp_path / "onef")
    finally:
        gate.unlink()
    done = finish_run(straight, tmp_path / "gpipe")
    assert done.returncode == 0, done.output[-4000:]
    # The P=2 x D=2 checkpoint at step 6 resumed at P=1 x D=2 (trainer.parallel=ddp).
    shrunk = start_run(tmp_path / "shrunk", *cluster, "cluster.workers=2",
                       f"trainer.max_steps={STEPS}", "run.name=shrunk",
                       f"resume={storage / 'gpipe' / 'step_000000006'}", cwd=project)
    again = finish_run(killed, tmp_path / "onef")
    assert again.returncode == 0, again.output[-4000:]
    resumed = finish_run(shrunk, tmp_path / "shrunk")
    assert resumed.returncode == 0, resumed.output[-4000:]

    reference = digits_mlp(STEPS)
    gpipe = sharded_model_at(storage, "gpipe", tmp_path / "cache")
    assert not not_close(gpipe, reference), not_close(gpipe, reference)
    assert sorted(gpipe) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
    # Killed and resumed, 1F1B: bit for bit the uninterrupted GPipe run (the same micro-batch
    # gradients, added in the same order).
    onef = sharded_model_at(storage, "onef", tmp_path / "cache")
    assert all(torch.equal(onef[k], gpipe[k]) for k in gpipe), "the killed 1F1B run differs"
    rec = again.record
    assert [(w["size"], w["step"]) for w in rec["world_sizes"]] == [(4, 0), (4, 6)]
    assert rec["metrics"] == done.record["metrics"]
    # At P=1: DDP over the same global batches, within float rounding of the reference.
    ddp = model_pt_at(storage, "shrunk")
    assert not not_close(ddp, reference), not_close(ddp, reference)
    assert resumed.record["resumed_from_step"] == 6


def test_tensor_parallel_and_a_sharded_pipeline_train_the_lm_as_one_process_does(ray_head,
                                                                                tmp_path):
    """The char LM example's GPT (its forward a chain of layers, its tensor_plan naming the
    attention's and MLP's layers), side by side: its attention heads and MLP split 2 ways over
    2 replicas (T=2 x D=2, DDP), and cut into 2 stages over 2 replicas that shard each stage
    (P=2 x D=2, trainer.parallel=fsdp), with gradient accumulation: gradient clipping over
    sharded gradients, weight decay, as one process."""
    model = {"dim": 32, "heads": 4, "layers": 2, "seq_len": 64}
    steps = 4
    common = ["+experiment=char_lm", f"cluster.address={ray_head.address}",
              f"storage.uri={tmp_path / 'ckpt'}", "cluster.workers=4", "cluster.cpus_per_worker=0.25",
              f"trainer.max_steps={steps}", f"trainer.model.dim={model['dim']}",
              "trainer.optimizer._target_=torch.optim.SGD", "trainer.lr=0.1"]
    lm = EXAMPLES / "char_lm"
    runs = {"tp": start_run(tmp_path / "tp", *common, "trainer.tensor.degree=2", "run.name=tp",
                            flags=("-cd", "conf"), cwd=lm),
            # 16 rows a replica, at most 2 a forward: 2 rounds of 4 pipeline micro-batches
            "pp": start_run(tmp_path / "pp", *common, "trainer.pipeline.degree=2",
                            "trainer.parallel=fsdp", "trainer.micro_batch_size=2", "run.name=pp",
                            flags=("-cd", "conf"), cwd=lm)}
    results = {name: finish_run(proc, tmp_path / name) for name, proc in runs.items()}
    for result in results.values():
        assert result.returncode == 0, result.output[-4000:]
    assert results["tp"].record["metrics"] == pytest.approx(results["pp"].record["metrics"], rel=1e-6)
    sys.path.insert(0, str(lm))
    try:
        reference = char_lm(steps, **model)
    finally:
        sys.path.pop(0)
    for name in runs:
        trained = sharded_model_at(tmp_path / "ckpt", name, tmp_path / "cache")
        assert sorted(trained) == sorted(reference)
        assert not not_close(trained, reference), (name, not_close(trained, reference))
