"""Hiding secrets in what the orchestrator writes to files (run.json, Hydra's .hydra files,
the sweep's sweep.json and scaling.md) and to the terminal and log files (every log record,
every error line).

By key: a value under a secret-looking name (``secret_key``, ``api_key``, ``auth``,
``password``...) is hidden whatever it is. By value, in every string: the credentials of a URL
(``scheme://user:pass@host``), ``name=value`` pairs with a secret-looking name (an override
such as ``storage.secret_key=...``, a query parameter such as ``X-Amz-Signature=...``), a
bearer token, and the values of the environment's secrets (AWS keys, ``RAY_AUTH_TOKEN``,
``HF_TOKEN``...), which reach the config through ``${oc.env:...}``.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from itertools import pairwise
from typing import Any

REDACTED = "***"
# Words that mark a name as a secret's, compared with the name's words (split at '_', '-',
# '.', and camelCase), so that "tokenizer", "max_tokens" or "author" are not taken for one.
# Not "pwd": the environment's PWD is the working directory, found in every path.
SECRET_WORDS = frozenset({"secret", "secrets", "password", "passwd", "passphrase",
                          "token", "credential", "credentials", "auth", "authorization",
                          "apikey", "signature", "cookie", "bearer"})
SECRET_PAIRS = frozenset({("api", "key"), ("access", "key"), ("private", "key"),
                          ("secret", "key"), ("session", "key"), ("client", "secret")})
# Environment variables that are secrets whatever their names say.
SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "RAY_AUTH_TOKEN")
# Shorter values are not searched for in text: a 3-character "secret" would hide every
# occurrence of its letters while protecting nothing.
MIN_SECRET_LEN = 6

_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
# A URL's userinfo, up to the '@' before its host: a user:secret pair may hold '/' (about half
# of AWS secret keys do) and '@'; a path's '@' (s3://bucket/users/jane@corp.com) is no userinfo.
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)(?:[^\s/?#@:]*:[^\s?#]*|[^\s/?#@]*)@"
                           r"(?=[^\s/?#@]*(?:[/?#\s'\"]|$))")
_PAIR = re.compile(r"""(?P<name>[A-Za-z_][\w.\-]*)(?P<eq>\s*=\s*)"""
                   r"""(?P<value>'[^']*'|"[^"]*"|[^\s&#;,'"]+)""")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[\w.~+/=\-]{8,}")


# A secret word followed by one of these names something about it, not the secret itself
# (pad_token_id, token_dropout, auth_token_path: RAY_AUTH_TOKEN_PATH is a file's path;
# RAY_AUTH_MODE=disabled, Ray's own advice, is a setting).
NOT_THE_SECRET = frozenset({"id", "ids", "dim", "dims", "dropout", "type", "types", "len",
                            "length", "count", "size", "path", "file", "dir", "sock", "url",
                            "endpoint", "index", "idx", "mode", "method", "scheme", "enabled"})


def is_secret_name(name: object) -> bool:
    """Whether a key (or an override's or a query parameter's name) names a secret; of a
    dotted path, its last part."""
    words = [w.lower() for w in _WORDS.findall(str(name).rsplit(".", 1)[-1])]
    if any(pair in SECRET_PAIRS for pair in pairwise(words)):  # AWS_ACCESS_KEY_ID too
        return True
    if words and words[-1] in NOT_THE_SECRET:
        return False
    return any(w in SECRET_WORDS for w in words)


def env_secrets(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values of the environment's secrets, longest first (a secret holding another is
    hidden whole)."""
    environ = os.environ if environ is None else environ
    values = {v for k, v in environ.items()
              if (k in SECRET_ENV or is_secret_name(k)) and len(v) >= MIN_SECRET_LEN}
    return sorted(values, key=len, reverse=True)


def redact_text(text: str, secrets: Iterable[str] | None = None) -> str:
    """``text`` with the secrets in it hidden (``secrets``: the values to hide; None: the
    environment's)."""
    for value in env_secrets() if secrets is None else secrets:
        if value:
            text = text.replace(value, REDACTED)
    # The substring tests skip the patterns that cannot match (run.json is redacted whole
    # each time it is written).
    if "@" in text:
        text = _URL_USERINFO.sub(rf"\1{REDACTED}@", text)
    if "earer" in text or "EARER" in text:
        text = _BEARER.sub(rf"\1{REDACTED}", text)
    if "=" in text:
        text = _PAIR.sub(lambda m: (f"{m['name']}{m['eq']}{REDACTED}"
                                    if is_secret_name(m["name"]) else m[0]), text)
    return text


def redact(value: Any, secrets: Iterable[str] | None = None, by_key: bool = True) -> Any:
    """A copy of a container (dicts, lists, strings) with every secret hidden: the secrets
    inside strings, and (``by_key``, for a config) every value under a secret-looking key."""
    secrets = env_secrets() if secrets is None else list(secrets)
    if isinstance(value, Mapping):
        return {k: (REDACTED if by_key and is_secret_name(k) and v is not None
                    else redact(v, secrets, by_key)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, secrets, by_key) for v in value]
    if isinstance(value, str):
        return redact_text(value, secrets)
    return value


def hide_secrets_in_logs() -> None:
    """Every log record this process makes, whatever its logger, has the secrets in its text
    and its traceback hidden (the terminal, Hydra's <job>.log): a record factory rather than a
    handler's filter, so that the handlers Hydra sets up later are covered too."""
    make = logging.getLogRecordFactory()
    if getattr(make, "hides_secrets", False):
        return

    def hidden(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        try:
            text = record.getMessage()
        except Exception:  # a malformed call: the handler reports it, as without this
            return record
        record.msg, record.args = redact_text(text), None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        return record

    hidden.hides_secrets = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(hidden)
