"""Users' own trainers, plugged in through trainer._target_: DDP with a bug at one step, and
DDP with a floor on its step time."""

from __future__ import annotations

import time

from trainers.ddp.trainer import DDPTrainer


class FailsAtStep35(DDPTrainer):
    def train(self, start_step: int) -> None:
        session, step_done = self.session, self.session.step_done

        def checked_step_done(step, metrics, samples):
            step_done(step, metrics, samples)
            if step == 35 and session.rank == 0:
                raise ValueError("bad batch at step 35 (a bug in the training code)")

        session.step_done = checked_step_done
        super().train(start_step)


class PacedDDP(DDPTrainer):
    """DDP whose steps take at least PACE_S more: a test that shrinks and grows a run needs
    the run to outlast what it does (a node joining, a resize), however fast the machine
    computes the digits model (~1 ms a step with 2 workers)."""

    PACE_S = 0.008

    def train(self, start_step: int) -> None:
        step_done = self.session.step_done

        def paced_step_done(step, metrics, samples):
            time.sleep(self.PACE_S)
            step_done(step, metrics, samples)

        self.session.step_done = paced_step_done
        super().train(start_step)
