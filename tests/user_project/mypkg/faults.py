"""The user's loop, with rank 1 killed (SIGKILL, once) while it writes its part of the
checkpoint at step trainer.crash_at: a crash in the middle of a checkpoint."""

import os
import signal
import time
from pathlib import Path

from mypkg.train import main


def crash_while_saving(ctx, cfg):
    crash_at, marker = int(cfg["trainer"]["crash_at"]), Path(cfg["trainer"]["marker"])
    # the checkpoint that must be committed before the crash (rank 0 commits in the
    # background: on a slow disk, still at it when rank 1 reached crash_at)
    committed = cfg["trainer"].get("committed_first")
    save = ctx.save

    def save_or_crash(step, write):
        if ctx.rank != 1 or step != crash_at or marker.exists():
            return save(step, write)

        def half_then_die(folder):
            write(folder)
            for f in folder.iterdir():  # half of each file, as a process dying mid-write leaves it
                f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
            marker.write_text(str(step))
            deadline = time.monotonic() + 300
            while committed and not Path(committed).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)

        return save(step, half_then_die)

    ctx.save = save_or_crash
    return main(ctx, cfg)
