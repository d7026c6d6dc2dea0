"""A served command's environment, against the one the service's Ray was started with.

Ray's processes (the workers, the processes kept ready) inherit the environment of the command
that started the service's Ray, not a later command's: the later command's own variables reach
its workers through the runtime environment (``for_workers``), and one whose credentials differ
(other AWS keys, another HF_TOKEN) is not served at all (``credentials_differ``): a variable
cannot be taken away from a process through the runtime environment, and the first command's
keys would win over the second's AWS_PROFILE.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from orchestrator.redaction import SECRET_ENV, is_secret_name, redact_text
from orchestrator.storage.location import CHAIN_ENV

# The environment the service's Ray processes were started with (None: not a service's Ray).
ray_started_with: dict[str, str] | None = None
# Each worker process's own, set by Ray or by the orchestrator for it.
NOT_HANDED_ON = ("CUDA_VISIBLE_DEVICES", "PWD", "OLDPWD", "SHLVL", "_", "PYTHONPATH")
# A terminal's or a login's own: they differ from shell to shell and mean nothing to a worker
# (handed on, they would also make the runtime environment differ from the ready processes').
SESSION_PREFIXES = ("SSH_", "TMUX", "TERM", "DISPLAY", "XDG_", "WINDOW", "COLUMNS", "LINES",
                    "PS1", "LS_COLORS", "STY", "VSCODE_", "COLORTERM", "LC_TERMINAL", "RAY_")


def is_credential(name: str, value: str | None) -> bool:
    """AWS keys and the chain's pointers, a secret-looking name, or a URL holding user:password
    (DATABASE_URL=postgres://u:pw@host): not to be handed on, nor served with another's."""
    return (name in SECRET_ENV or name in CHAIN_ENV or is_secret_name(name)
            or (value is not None and redact_text(value, secrets=[]) != value))


def credentials_differ(env: Mapping[str, str]) -> list[str]:
    """The names of the credential variables (AWS keys and the chain's pointers, tokens) that
    differ between ``env`` and the service's Ray's; never their values."""
    if ray_started_with is None:
        return []
    names = set(env) | set(ray_started_with)
    return sorted(n for n in names if env.get(n) != ray_started_with.get(n) and (
        is_credential(n, env.get(n)) or is_credential(n, ray_started_with.get(n))))


def for_workers() -> dict[str, str]:
    """This command's variables that the service's Ray processes do not have as it has them."""
    if ray_started_with is None:
        return {}
    return {k: v for k, v in os.environ.items()
            if ray_started_with.get(k) != v and k not in NOT_HANDED_ON
            and not k.startswith(SESSION_PREFIXES) and not is_credential(k, v)}
