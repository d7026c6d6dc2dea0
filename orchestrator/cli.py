"""`python -m orchestrator`: check the input, then hand over to Hydra and the launcher.

Hydra reports a bad override as a multi-line error with exit code 1. Users get one line and
exit code 2 instead: the overrides are composed and checked here first (every trial of a
--multirun sweep included), before any worker starts (Ray itself may start beside the
checks of a plain run: orchestrator/driver/session_start.py).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from orchestrator.config.once import one_command
from orchestrator.config.preflight import check_command_line
from orchestrator.config.schema import register_configs
from orchestrator.errors import ConfigError, print_error
from orchestrator.ray_internals.versions import untested

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
INTERRUPTED_EARLY = "interrupted before training started; nothing was written"
STARTED_AT = time.time()

register_configs()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def hydra_app(cfg: DictConfig) -> None:
    try:
        from orchestrator.driver.launch import launch

        code = launch(cfg, Path(HydraConfig.get().runtime.output_dir), STARTED_AT)
    except KeyboardInterrupt:  # before training started (Ray's start, the checks): nothing ran
        print(INTERRUPTED_EARLY, file=sys.stderr, flush=True)
        code = 130
    if code:
        sys.exit(code)


# Keys whose value is a command line: `trainer.command="torchrun --nproc-per-node=2 x.py"`
# reaches us unquoted (the shell took the quotes), and Hydra cannot parse its '=' and spaces.
COMMAND_KEYS = ("trainer.command=",)


def start_ray_beside_the_trial(cfg: DictConfig, typed) -> None:
    from orchestrator.driver.session_start import start_early  # imports ray: only for a run

    start_early(cfg, typed)


def abandon_early() -> bool:
    """Stop a Ray the run did not take (bad input, Ctrl-C); whether there was one."""
    if "orchestrator.driver.session_start" not in sys.modules:
        return False
    from orchestrator.driver.session_start import abandon_early as abandon

    return abandon()


def quote_commands(argv: list[str]) -> list[str]:
    """Give a command-line value the quotes Hydra needs (one it already quoted stays)."""
    quoted = []
    for arg in argv:
        key = next((k for k in COMMAND_KEYS if arg.lstrip("+").startswith(k)), None)
        if key is not None:
            prefix, value = arg[: arg.index("=") + 1], arg[arg.index("=") + 1:]
            if not (len(value) >= 2 and value[0] == value[-1] and value[0] in "'\""):
                arg = prefix + "'" + value.replace("'", "\\'") + "'"
        quoted.append(arg)
    return quoted


def main(started_at: float = STARTED_AT) -> None:
    from orchestrator.driver.interrupts import sigterm_as_ctrl_c

    sigterm_as_ctrl_c()  # kill, timeout, docker stop: as a Ctrl-C (run.json says interrupted)
    exit_now(run_command(sys.argv[1:], started_at))


def run_command(argv: list[str], started_at: float) -> int:
    """One command, start to end, in this process: its exit code. Called once by a plain
    command, and once per command by a kept-alive service (orchestrator/service/)."""
    global STARTED_AT
    STARTED_AT = started_at
    sys.argv[1:] = quote_commands(argv)
    for line in untested():  # a Ray or torch outside the tested range: its speed hooks off
        print(f"warning: {line}", file=sys.stderr, flush=True)
    with one_command():  # the checks below are the launch's too (orchestrator/config/once.py)
        try:
            # Ray starts beside the trial of the user's parts (orchestrator/driver/session_start.py).
            check_command_line(sys.argv[1:], CONF_DIR, before_parts=start_ray_beside_the_trial)
        except ConfigError as exc:
            print_error(str(exc))
            abandon_early()
            return exc.exit_code
        except KeyboardInterrupt:  # Ctrl-C during the checks (the trial of the user's parts)
            abandon_early()
            print(INTERRUPTED_EARLY, file=sys.stderr, flush=True)
            return 130
        except BaseException:
            abandon_early()
            raise
        try:
            hydra_app()
        except SystemExit as done:  # the run's exit code
            code = done.code
        except KeyboardInterrupt:  # in Hydra's own steps around the run
            print(INTERRUPTED_EARLY, file=sys.stderr, flush=True)
            code = 130
        else:
            code = 0
        finally:  # nothing left when the run took the session
            abandon_early()
    if isinstance(code, str):  # a message (Hydra's), as Python's exit would print it
        print(code, file=sys.stderr)
        code = 1
    return code or 0


def exit_now(code: int) -> NoReturn:
    """End the command without the interpreter's own teardown: ~1 s of freeing modules
    (torch, Ray, Hydra) after everything is written and printed. What a normal exit does
    before that still happens: the other threads are joined, the atexit handlers (Ray's, a
    user's module's) run, the logs and the terminal output are flushed."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
