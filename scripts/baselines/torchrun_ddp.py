"""Baseline: plain torch.distributed (gloo) DDP under torchrun, with the orchestrator's loop.

    torchrun --standalone --nproc-per-node=2 scripts/baselines/torchrun_ddp.py \
        --data synthetic --rows 100000 --features 64 --classes 10 --batch-size 512 \
        --max-steps 3000 --out result.json

No Ray at all: the same data, model and loss (scripts/baselines/ddp_job.py) in DDP over gloo.
Rank 0 prints JSON: the first step's end, the steady-state samples/s, test metrics.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from scripts.baselines.ddp_job import add_job_args, build, emit, evaluate, train  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_args(parser)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    job = build(args)
    timings = train(job, DistributedDataParallel(job.model), rank, world, args.batch_size)
    metrics = evaluate(job)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        emit({**timings, **metrics, "workers": world,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}, args.out)


if __name__ == "__main__":
    main()
