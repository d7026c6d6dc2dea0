"""Users' own training functions, plugged in through trainer.fn: the built-in DDP loop with a
bug at one step, held at a step by a gate file, and functions the driver must refuse."""

from __future__ import annotations

import os
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


def fails_for_one_lr(ctx, cfg):
    """The DDP loop with a bug at step 15, when trainer.lr is trainer.fail_lr (one trial of a
    sweep fails, the others do not)."""
    if cfg["trainer"]["lr"] != cfg["trainer"].pop("fail_lr"):
        return ddp_main(ctx, cfg)
    step_done = ctx.step_done

    def checked_step_done(step, metrics=None, samples=0):
        step_done(step, metrics, samples)
        if step == 15 and ctx.rank == 0:
            raise ValueError("bad batch at step 15 (a bug in the training code)")

    ctx.step_done = checked_step_done
    return ddp_main(ctx, cfg)


PACE_S = 0.008


def gated_ddp(ctx, cfg):
    """The DDP loop held at a step while a gate file exists: a test that injects faults
    mid-run (a node lost or added, a partition, Ctrl-C) needs the run to last until it is
    done, on a fast machine or a slow one, and then to finish at once.

        trainer.fn=tests.user_trainers:gated_ddp +trainer.gate=/shared/gate +trainer.hold_at=1500

    The gate must be a path every host sees. Each step also takes at least PACE_S, so that a
    fault lands mid-run. The math is the DDP trainer's, untouched."""
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


def takes_one_argument(ctx):
    return None


NOT_A_FUNCTION = 42
