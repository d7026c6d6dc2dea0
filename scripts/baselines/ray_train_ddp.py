"""Baseline: a plain Ray Train (V2) TorchTrainer script, with the orchestrator's DDP loop.
From the repository root:

    python scripts/baselines/ray_train_ddp.py                      # the default job: digits, 2 workers
    python scripts/baselines/ray_train_ddp.py --data synthetic --rows 100000 --features 64 \
        --classes 10 --batch-size 512 --max-steps 3000 --out result.json

What a user would write without the orchestrator: ray.init on an embedded local Ray (its
defaults, dashboard included), a TorchTrainer with 2 workers of 1 CPU, prepare_model, the same
data, model and loss (scripts/baselines/ddp_job.py), no checkpoints, one report at the end.
Prints JSON: script start, the first step's end, the steady-state samples/s, test metrics.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

STARTED_AT = time.time()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import ray  # noqa: E402
import ray.train  # noqa: E402
import ray.train.torch  # noqa: E402

# The workers import these from the current directory (Ray puts the driver's on their path):
# run this script from the repository root.
from scripts.baselines.ddp_job import add_job_args, build, emit, evaluate, train  # noqa: E402


def train_loop_per_worker(config: dict) -> None:
    args = argparse.Namespace(**config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    job = build(args)
    model = ray.train.torch.prepare_model(job.model)
    timings = train(job, model, rank, world, args.batch_size)
    metrics = {**timings, **evaluate(job)}
    ray.train.report(metrics)
    if rank == 0:  # Train V2 keeps metrics only with a checkpoint: hand them over in a file
        Path(config["result_file"]).write_text(json.dumps(metrics))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_args(parser)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    ray.init(address="local")  # a new embedded instance, never someone else's cluster
    with tempfile.TemporaryDirectory(prefix="ray-train-ddp-") as storage:
        result_file = Path(storage) / "result.json"
        trainer = ray.train.torch.TorchTrainer(
            train_loop_per_worker,
            train_loop_config={**vars(args), "result_file": str(result_file)},
            scaling_config=ray.train.ScalingConfig(num_workers=args.workers),
            run_config=ray.train.RunConfig(storage_path=storage),
        )
        trainer.fit()
        metrics = json.loads(result_file.read_text())
    ray.shutdown()
    emit({"started_at": STARTED_AT, **metrics, "workers": args.workers}, args.out)


if __name__ == "__main__":
    main()
