"""Relative paths in a config are the user's, relative to the directory the command ran in.

Workers run in Ray's session folders and a sweep's trials in Tune's: a relative `data.path`
passed on as given is looked up there (seen: `data.path=train.parquet` passed the driver's
checks, then failed on every worker; a sweep's checkpoints went to Ray's temporary folder and
a rerun could not find them). Each is made absolute once, on the driver.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

PATH_KEYS = ("data.path", "data.eval_path", "storage.uri", "resume", "trainer.workdir")
NOT_PATHS = {"resume": ("auto", "never")}


def resolve_paths(cfg: DictConfig, base: Path) -> None:
    """Rewrite every local relative path of PATH_KEYS in cfg as an absolute one under base."""
    for key in PATH_KEYS:
        value = OmegaConf.select(cfg, key, default=None)
        if not isinstance(value, str) or not value.strip() or "://" in value:
            continue
        if value in NOT_PATHS.get(key, ()):
            continue
        path = Path(os.path.expanduser(value))
        if path.is_absolute() and path == Path(value):
            continue
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        with open_dict(node):
            node[leaf] = os.path.normpath(base / path)
    resolve_tracking_uri(cfg, base)


def resolve_tracking_uri(cfg: DictConfig, base: Path) -> None:
    """tracking.uri's local store (file:./mlruns, sqlite:///mlflow.db, a folder) under base."""
    from orchestrator.tracking.uri import absolute_uri

    uri = OmegaConf.select(cfg, "tracking.uri", default=None)
    if isinstance(uri, str) and uri.strip() and absolute_uri(uri, base) != uri:
        with open_dict(cfg.tracking):
            cfg.tracking.uri = absolute_uri(uri, base)
