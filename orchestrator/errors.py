"""Wrong input as an exception (exit code 2, docs/exit-codes.md), and an exception's message
as the one line a user reads."""

import sys

from orchestrator.redaction import redact_text


class ConfigError(ValueError):
    """Wrong input (config, path, credentials, dataset): exit 2, before any worker starts.

    The message is one line that names the key and what is allowed.
    """

    exit_code = 2


class MachineError(ConfigError):
    """The machine or the cluster failed before any worker started (Ray did not start): one
    line, printed as wrong input is, but exit 1: running the command again may work."""

    exit_code = 1


def cause_of(exc: BaseException) -> BaseException:
    """Hydra's instantiate wraps what the user's code raised ("Error in call to target
    'x':"): the cause is what the user must read."""
    if type(exc).__name__ == "InstantiationException" and exc.__cause__ is not None:
        return exc.__cause__
    return exc


def one_line(exc: BaseException | str) -> str:
    """An exception's message (or a text) in one line: its first line, and the next one when
    the first only announces it ("Error loading 'x':"); the exception's type when empty.
    Every one-line error text is made here."""
    fallback = type(exc).__name__ if isinstance(exc, BaseException) else "(no message)"
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [fallback]
    if len(lines) > 2 and lines[0].startswith("Caught ") and lines[1].startswith("Original Trace"):
        # torch re-raises a DataLoader process's error with its traceback as the message: the
        # user's own words are its last line ("IndexError: bad row 37")
        name, last = fallback, lines[-1]
        last = last[len(name) + 2:] if last.startswith(f"{name}: ") else last
        return f"{last} (in {lines[0].split(' in ', 1)[-1].rstrip('.')})"
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def print_error(text: str) -> None:
    """The orchestrator's `error: ...` line on stderr, with any secret in it hidden (a value
    quoted back from a URL or the environment)."""
    print(f"error: {redact_text(text)}", file=sys.stderr, flush=True)
