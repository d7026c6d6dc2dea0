"""The built-in DDP loop held at a step while a gate file exists: a test that injects faults
mid-run (a partition, a lost host, a node rejoining) needs the run to last until it is done,
on a fast machine or a slow one, and then to finish at once.

    trainer.fn=tests.gated_trainer:gated_ddp +trainer.gate=/shared/gate +trainer.hold_at=1500

The gate must be a path every host sees (a shared mount). Each step also takes at least
PACE_S, so that a fault lands mid-run. The math is the DDP trainer's, untouched."""

from __future__ import annotations

import os
import time

from trainers.pytorch.train import main as ddp_main

PACE_S = 0.008


def gated_ddp(ctx, cfg):
    gate, hold_at = cfg["trainer"].pop("gate"), int(cfg["trainer"].pop("hold_at"))
    step_done = ctx.step_done

    def gated_step_done(step, metrics=None, samples=0):
        time.sleep(PACE_S)
        # Every rank holds at the same step, outside any collective: nothing times out.
        while step >= hold_at and os.path.exists(gate):
            time.sleep(0.05)
        step_done(step, metrics, samples)

    ctx.step_done = gated_step_done
    return ddp_main(ctx, cfg)
