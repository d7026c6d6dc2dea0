"""Shared fixtures: the command line as a subprocess, and one real Ray head per test module."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from scripts.local_cluster import (  # noqa: F401  (re-exported for the test modules)
    RayHead,
    add_node,
    clean_env,
    free_port,
    start_head,
    stop_head,
)

REPO = Path(__file__).resolve().parent.parent


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def record(self) -> dict:
        return json.loads((self.run_dir / "run.json").read_text())

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def cli_command(run_dir: Path, *overrides: str, flags: tuple[str, ...] = ()) -> list[str]:
    # Hydra's argparse wants its flags before the overrides.
    return [sys.executable, "-m", "orchestrator", *flags, f"hydra.run.dir={run_dir}", *overrides]


def cli_env(extra: dict | None = None) -> dict:
    return clean_env(extra)


def run_cli(run_dir: Path, *overrides: str, env: dict | None = None, timeout: float = 600,
            flags: tuple[str, ...] = (), cwd: Path = REPO) -> CliResult:
    proc = subprocess.run(cli_command(run_dir, *overrides, flags=flags), cwd=cwd, env=cli_env(env),
                          capture_output=True, text=True, timeout=timeout)
    return CliResult(proc.returncode, proc.stdout, proc.stderr, run_dir)


def user_project(tmp_path: Path) -> Path:
    """A copy of tests/user_project (a user's own package, mypkg) outside the repository."""
    import shutil

    target = tmp_path / "project"
    shutil.copytree(REPO / "tests" / "user_project", target,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return target


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    head = start_head(tmp_path_factory.mktemp("ray-head"))
    yield head
    stop_head(head.process)


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """A real SeaweedFS S3 server on free loopback ports, stopped by pid afterwards."""
    from scripts.s3_server import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("seaweed")).start()
    yield server
    server.stop(kill=True)
