"""Users' own training functions, plugged in through trainer.fn: the built-in DDP loop with a
bug at one step, with a floor on its step time, and functions the driver must refuse."""

from __future__ import annotations

import time

from trainers.pytorch.train import main as ddp_main


def fails_at_step_35(ctx, cfg):
    step_done = ctx.step_done

    def checked_step_done(step, metrics=None, samples=0):
        step_done(step, metrics, samples)
        if step == 35 and ctx.rank == 0:
            raise ValueError("bad batch at step 35 (a bug in the training code)")

    ctx.step_done = checked_step_done
    return ddp_main(ctx, cfg)


PACE_S = 0.008


def paced_ddp(ctx, cfg):
    """DDP whose steps take at least PACE_S more: a test that shrinks and grows a run needs
    the run to outlast what it does (a node joining, a resize), however fast the machine
    computes the digits model (~1 ms a step with 2 workers)."""
    step_done = ctx.step_done

    def paced_step_done(step, metrics=None, samples=0):
        time.sleep(PACE_S)
        step_done(step, metrics, samples)

    ctx.step_done = paced_step_done
    return ddp_main(ctx, cfg)


def takes_one_argument(ctx):
    return None


NOT_A_FUNCTION = 42
