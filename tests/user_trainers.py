"""A user's own trainer, plugged in through trainer._target_: DDP with a bug at one step."""

from __future__ import annotations

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
