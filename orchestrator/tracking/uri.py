"""tracking.uri: what a user may give, made absolute, and whether the server answers.

Checked before Ray starts and without importing MLflow (~2 s): the one line of a refused
command must not wait for either.
"""

from __future__ import annotations

import importlib.util
import os
import re
import urllib.error
import urllib.request
from pathlib import Path

from orchestrator.errors import ConfigError
from orchestrator.redaction import redact_text

ALLOWED = "http(s)://host:port, file:./mlruns, sqlite:///mlflow.db, or a folder"
SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks")
ANSWER_WITHIN_S = 5.0
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*):")


def scheme_of(uri: str) -> str | None:
    match = _SCHEME.match(uri)
    # A Windows drive (C:\runs) is a path, not a scheme.
    return match.group(1).lower() if match and len(match.group(1)) > 1 else None


def absolute_uri(uri: str, base: Path) -> str:
    """A local store's relative path made absolute under ``base`` (the command's folder): a
    sweep's trial runs in Tune's folder, and must log where the command said."""
    scheme = scheme_of(uri)
    if uri == "databricks":  # MLflow's name for a Databricks workspace, not a folder
        return uri
    if scheme is None:
        return str(base / os.path.expanduser(uri))
    if scheme == "file" and not uri.startswith("file://"):  # file:./mlruns, file:mlruns
        return "file://" + os.path.normpath(base / uri[len("file:"):])
    if scheme == "sqlite" and uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.normpath(base / uri[len("sqlite:///"):])
    return uri


def tracking_uri(given: str | None) -> str:
    """The URI MLflow gets: tracking.uri, else MLflow's own MLFLOW_TRACKING_URI."""
    uri = given or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise ConfigError(f"tracking.uri: required with tracking=mlflow ({ALLOWED}; or set "
                          "MLFLOW_TRACKING_URI)")
    scheme = scheme_of(uri)
    if scheme is not None and scheme not in SCHEMES:
        raise ConfigError(f"tracking.uri={shown(uri)}: not a tracking store MLflow reads "
                          f"({ALLOWED})")
    return uri


def shown(uri: str) -> str:
    """The URI as it may be printed or written: credentials in it are not."""
    return redact_text(uri, secrets=())


def run_page(uri: str, experiment_id: str | None, run_id: str) -> str:
    """An MLflow run's page on a server, else its id and store, as printed."""
    base = shown(uri).rstrip("/")
    if base.startswith(("http://", "https://")):
        return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"
    return f"{run_id} in {base}"


def check_tracking(name: str, given: str | None, required: bool) -> str | None:
    """None when the server answers (or tracking is off); else why not, for a run with
    tracking.required=false to warn about. ConfigError (exit 2) for anything else."""
    if name == "none":
        return None
    uri = tracking_uri(given)
    if importlib.util.find_spec("mlflow") is None:
        raise ConfigError("tracking=mlflow: the mlflow package is not installed here (pip "
                          "install mlflow-skinny; a sqlite:// store needs mlflow)")
    problem = unanswered(uri)
    if problem and required:
        raise ConfigError(f"tracking.uri={shown(uri)}: {problem}; start it, correct "
                          "tracking.uri, or set tracking.required=false to train without it "
                          "until it answers")
    return problem


def unanswered(uri: str) -> str | None:
    """Why the store cannot be reached, or None. A server answers with any HTTP status (a
    proxy asking for credentials answers too: MLflow's client sends them)."""
    scheme = scheme_of(uri)
    if scheme in ("http", "https"):
        request = urllib.request.Request(uri.rstrip("/") + "/health", method="GET")
        try:
            with urllib.request.urlopen(request, timeout=ANSWER_WITHIN_S):
                return None
        except urllib.error.HTTPError:
            return None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            return f"the tracking server does not answer ({redact_text(str(reason), ())})"
    if scheme in (None, "file", "sqlite") and uri != "databricks":
        return local_store_problem(uri, scheme)
    return None  # a database or a hosted service: MLflow's client says, at the run's start


def local_store_problem(uri: str, scheme: str | None) -> str | None:
    if scheme == "file":
        path = Path(uri[len("file://"):] if uri.startswith("file://") else uri[len("file:"):])
    elif scheme == "sqlite":
        if importlib.util.find_spec("sqlalchemy") is None:
            return "a sqlite:// store needs the mlflow package (mlflow-skinny has no SQL store)"
        path = Path(uri[len("sqlite:///"):]).parent
    else:
        path = Path(uri)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing or path} is not a folder this user can write in"
    return None
