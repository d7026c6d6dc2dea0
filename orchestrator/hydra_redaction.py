"""Hydra's own record of a job (.hydra/config.yaml, hydra.yaml, overrides.yaml) without
secrets: a credential given on the command line or in a URL would otherwise stay on disk.

Hydra writes those files just before it calls the callbacks' ``on_job_start``; this callback
(registered in conf/config.yaml under hydra.callbacks) rewrites them at once, each replaced
whole by a rename, with the same redaction as run.json (orchestrator/redaction.py). It runs
for a single run and for every trial of a sweep (trials go through Hydra's run_job too).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from orchestrator.redaction import env_secrets, redact

HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")


def redact_hydra_files(folder: Path) -> list[Path]:
    """Rewrite the Hydra files in ``folder`` that hold a secret; returns those rewritten."""
    secrets = env_secrets()
    rewritten = []
    for name in HYDRA_FILES:
        path = folder / name
        if not path.is_file():
            continue
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        clean = redact(data, secrets)
        if clean == data:
            continue
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(yaml.safe_dump(clean, sort_keys=False, allow_unicode=True),
                       encoding="utf-8")
        os.replace(tmp, path)
        rewritten.append(path)
    return rewritten


class RedactHydraFiles(Callback):
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        subdir = config.hydra.output_subdir
        if subdir is not None:  # null: Hydra wrote none
            redact_hydra_files(Path(str(config.hydra.runtime.output_dir)) / str(subdir))
