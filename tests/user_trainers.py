"""Users' own training functions, plugged in through trainer.fn: the built-in DDP loop with a
bug at one step, any trainer paced and held by a gate file, and functions the driver must
refuse."""

from __future__ import annotations

import os
import time

from orchestrator.worker.training_function import import_function
from orchestrator.worker_api import training_function

DDP = "trainers.pytorch.train:main"  # the built-in PyTorch trainer (trainer=ddp|fsdp)


def fails_at_step_35(ctx, cfg):
    step_done = ctx.step_done

    def checked_step_done(step, metrics=None, samples=0):
        step_done(step, metrics, samples)
        if step == 35 and ctx.rank == 0:
            raise ValueError("bad batch at step 35 (a bug in the training code)")

    ctx.step_done = checked_step_done
    return import_function(DDP)(ctx, cfg)


def fails_for_one_lr(ctx, cfg):
    """The DDP loop with a bug at step 15, when trainer.lr is trainer.fail_lr (one trial of a
    sweep fails, the others do not); with trainer.slow_lr, that trial's steps after step 20
    take half a second each, so a scheduler that stops it there does so while it runs, however
    fast the machine (if none does, it ends ~45 s later)."""
    slow = cfg["trainer"]["lr"] == cfg["trainer"].pop("slow_lr", None)
    if cfg["trainer"]["lr"] != cfg["trainer"].pop("fail_lr"):
        if slow:
            step_done = ctx.step_done

            def slow_step_done(step, metrics=None, samples=0):
                step_done(step, metrics, samples)
                if step > 20:
                    time.sleep(0.5)

            ctx.step_done = slow_step_done
        return import_function(DDP)(ctx, cfg)
    step_done = ctx.step_done

    def checked_step_done(step, metrics=None, samples=0):
        step_done(step, metrics, samples)
        if step == 15 and ctx.rank == 0:
            raise ValueError("bad batch at step 15 (a bug in the training code)")

    ctx.step_done = checked_step_done
    return import_function(DDP)(ctx, cfg)


PACE_S = 0.008


def gated(ctx, cfg):
    """Any training function (trainer.inner, module:function) with its steps gated by a file:
    a test that injects faults mid-run (a node lost or added, a partition, a preemption, Ctrl-C)
    needs the run to last until it is done, on a fast machine or a slow one, and then to
    finish at once.

        trainer.fn=tests.user_trainers:gated +trainer.inner=trainers.mwms.train:main
        +trainer.gate=/shared/gate [+trainer.hold_at=1500] [+trainer.pace_s=0.05]

    While the gate exists, each step takes at least trainer.pace_s (so that a fault lands
    mid-run), and a run holds at trainer.hold_at, if given; with +trainer.hold_for_notice=true
    it holds there only until a preemption notice is agreed on (ctx.check_preemption, every
    rank together), so that a preemption test's job saves at the notice, however late it
    comes, and has only a few steps left after it. The gate must be a path every host sees.
    The function's own work is untouched: only ctx.step_done waits."""
    tcfg = cfg["trainer"]
    inner = import_function(tcfg.pop("inner"))
    gate, pace_s = tcfg.pop("gate"), float(tcfg.pop("pace_s", PACE_S))
    hold_at = int(tcfg.pop("hold_at", 0) or 0)
    for_notice = bool(tcfg.pop("hold_for_notice", False))
    step_done = ctx.step_done

    def gated_step_done(step, metrics=None, samples=0):
        if os.path.exists(gate):
            time.sleep(pace_s)
        # Every rank holds at the same step, outside any collective: nothing times out.
        while hold_at and not for_notice and step >= hold_at and os.path.exists(gate):
            time.sleep(0.05)
        step_done(step, metrics, samples)
        if for_notice and step == hold_at:
            # Every rank asks together (two barriers) whether to go on: rank 0's view of the
            # gate, or a notice they all agreed on (at this step: the function saves here).
            while ctx.broadcast(os.path.exists(gate)) and not ctx.check_preemption():
                time.sleep(0.5)

    ctx.step_done = gated_step_done
    return inner(ctx, cfg)


@training_function(streams=True)
def gated_ddp(ctx, cfg):
    """gated() over the PyTorch trainer (trainer=ddp|fsdp), which reads streamed data too."""
    cfg["trainer"]["inner"] = DDP
    return gated(ctx, cfg)


def takes_one_argument(ctx):
    return None


NOT_A_FUNCTION = 42


def _count_the_check(cfg):
    """Appends a line to $CHECK_COUNT_FILE each time the driver checks the function."""
    with open(os.environ["CHECK_COUNT_FILE"], "a") as out:
        out.write("checked\n")


@training_function(check=_count_the_check)
def counts_its_checks(ctx, cfg):
    """A function whose driver-side check (a user's trial of their parts) counts its calls."""
    return None


def _its_metrics(cfg):
    return ["score", "train_score"]


@training_function(check=_its_metrics)
def reports_a_score(ctx, cfg):
    """A function whose check says what the run reports: a sweep may compare trials by score."""
    ctx.step_done(1, {"train_score": 1.0})
    return {"score": 1.0}


@training_function(check=lambda cfg: 0.5)
def check_returns_a_number(ctx, cfg):
    return None


def _asserts_steps(cfg):
    assert cfg["trainer"].get("steps", 1) >= 1, "steps must be >= 1"


@training_function(check=_asserts_steps)
def checks_with_an_assert(ctx, cfg):
    """A user's check the way people write them: an assert, not a ConfigError."""
    return None
