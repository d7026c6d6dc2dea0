"""Every error example of README.md and docs/*.md is what the command prints today.

An example is a `$ python -m orchestrator <overrides>` line in a ```console block, followed on
the next line by the `error: ...` line it prints; a `$ cd <folder>` line in the block runs the
commands after it from that folder of the repository (copied to a temporary folder first, so
that nothing is written into the repository). Only input that fails before Ray starts belongs
in a console block: each command runs with its own storage folder, side by side with the
others (CliBatch), and must exit with code 2 and print exactly the documented line, alone on
stderr. Output that needs a cluster is shown in a ```text block instead; an example in any
other kind of block is refused, so that none goes unchecked (docs/testing.md).
"""

from __future__ import annotations

import re
import shlex
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, CliBatch

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND = "$ python -m orchestrator "
CD = "$ cd "
ERROR = "error: "
FENCE = re.compile(r"^(`{3,})([\w-]*)\s*$")
CHECKED, ILLUSTRATION = "console", "text"


@dataclass(frozen=True)
class Example:
    where: str  # page:line of the command
    folder: str  # the repository folder it runs from ("" for the root)
    args: tuple[str, ...]
    error: str  # the documented line, "error: ..." included

    @property
    def key(self) -> tuple[str, tuple[str, ...]]:
        return self.folder, self.args


def blocks(path: Path) -> Iterator[tuple[str, int, list[str]]]:
    """(info string, line number of the first line inside, lines) of each fenced block."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        start = i + 1
        end = next((j for j in range(start, len(lines)) if lines[j].strip() == opened[1]),
                   len(lines))
        yield opened[2], start + 1, lines[start:end]
        i = end + 1


def read_examples() -> tuple[list[Example], list[str]]:
    """The checked examples, and what is wrong with the pages (examples outside a console
    block, a command without its error line or an error line without its command)."""
    examples, problems = [], []
    for page in PAGES:
        name = page.relative_to(REPO).as_posix()
        for info, first, lines in blocks(page):
            folder = ""
            for n, line in enumerate(lines):
                where = f"{name}:{first + n}"
                follows = lines[n + 1] if n + 1 < len(lines) else ""
                if info != CHECKED:
                    if line.startswith(COMMAND) and follows.startswith(ERROR) \
                            and info != ILLUSTRATION:
                        problems.append(f"{where}: an error example in a ```{info} block")
                    continue
                if line.startswith(CD):
                    folder = line[len(CD):].strip()
                elif line.startswith(COMMAND):
                    if not follows.startswith(ERROR):
                        problems.append(f"{where}: a command without its error line")
                        continue
                    args = tuple(shlex.split(line[len(COMMAND):]))
                    examples.append(Example(where, folder, args, follows))
                elif line.startswith(ERROR):
                    if not (n and lines[n - 1].startswith(COMMAND)):
                        problems.append(f"{where}: an error line without its command")
                elif line.strip():
                    problems.append(f"{where}: neither a command, a cd nor an error line")
    return examples, problems


EXAMPLES, PROBLEMS = read_examples()


def test_the_pages_follow_the_convention():
    assert not PROBLEMS, "\n".join(PROBLEMS)
    assert len(EXAMPLES) >= 10  # the parser found them: a changed convention finds none
    for folder in {e.folder for e in EXAMPLES if e.folder}:
        assert (REPO / folder).is_dir(), folder


@pytest.fixture(scope="module")
def batches(tmp_path_factory) -> dict[str, CliBatch]:
    """One batch per folder the examples run from; each distinct command runs once."""
    base = tmp_path_factory.mktemp("docs-examples")
    result = {}
    for i, folder in enumerate(sorted({e.folder for e in EXAMPLES})):
        cwd = REPO
        if folder:
            cwd = base / f"project{i}" / Path(folder).name
            shutil.copytree(REPO / folder, cwd, ignore=shutil.ignore_patterns("__pycache__"))
        cases = {e.args: list(e.args) for e in EXAMPLES if e.folder == folder}
        result[folder] = CliBatch(base / f"runs{i}", cases, cwd=cwd)
    return result


def listening(args: tuple[str, ...]) -> str | None:
    """The cluster.address an example expects nothing at, if something answers there now."""
    for arg in args:
        host, _, port = arg.removeprefix("cluster.address=").rpartition(":")
        if arg.startswith("cluster.address=") and port.isdigit():
            try:
                with socket.create_connection((host, int(port)), timeout=1):
                    return f"{host}:{port}"
            except OSError:
                return None
    return None


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.where for e in EXAMPLES])
def test_the_documented_error_is_what_the_command_prints(batches, example):
    taken = listening(example.args)
    if taken:
        pytest.skip(f"something answers at {taken} on this machine")
    batch = batches[example.folder]
    result = batch.result(example.args)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2, result.output[-3000:]
    assert lines == [example.error], (
        f"{example.where}: the docs say\n  {example.error}\nthe command printed\n  "
        + "\n  ".join(lines))
    assert "Started a local Ray" not in result.output and "RayTrainWorker" not in result.output
    storage = batch.storage(example.args)
    assert not storage.exists() or not any(storage.rglob("*")), "storage was written"


def recipe(path: Path) -> list[str]:
    """The commands of a page's bash block that joins a cluster (its `ray start --head`)."""
    for kind, _, lines in blocks(path):
        if kind == "bash" and any(line.startswith("ray start --head") for line in lines):
            return [line.split("  #")[0].strip() for line in lines if line.strip()]
    raise AssertionError(f"{path.name}: no block with `ray start --head`")


def test_the_cluster_recipe_runs_as_written(ray_head, s3_server, bucket, tmp_path):
    """README's and docs' `ray job submit` line, run from a user's folder against a head
    started from the project's environment (the shared one: scripts/local_cluster.py puts
    the project's Python first on its PATH, as `source .venv/bin/activate` does) with token
    auth: the job's `python` is the project's, its credentials come from the AWS chain on the
    cluster (a profile file named through --runtime-env-json), and its run record, written in
    Ray's temporary copy of the folder, is copied beside the checkpoints and printed."""
    import json
    import subprocess

    from scripts.local_cluster import RAY, node_env
    from tests.conftest import user_project

    submit = "RAY_AUTH_MODE=token ray job submit --working-dir . -- python -m orchestrator " \
             "cluster.address=auto storage=s3 storage.uri=s3://bucket/ckpt"
    for page in (REPO / "README.md", REPO / "docs" / "storage-and-clusters.md"):
        assert recipe(page) == ["source .venv/bin/activate", "ray start --head",
                                "python -m orchestrator cluster.address=auto cluster.workers=8",
                                submit], page
    profile = tmp_path / "credentials"  # on "the cluster": this machine's disk
    profile.write_text(f"[train]\naws_access_key_id = {s3_server.access_key}\n"
                       f"aws_secret_access_key = {s3_server.secret_key}\n")
    profile.chmod(0o600)
    runtime_env = {"env_vars": {"AWS_PROFILE": "train", "AWS_SHARED_CREDENTIALS_FILE": str(profile),
                                "AWS_EC2_METADATA_DISABLED": "true"}}
    env, args = node_env(), submit.split()
    env.update(arg.split("=", 1) for arg in args[:1])  # RAY_AUTH_MODE=token
    env = {k: v for k, v in env.items() if not k.startswith("AWS_")}  # the shell's keys: none
    args = [RAY, *args[2:4], f"--address={ray_head.dashboard}",
            f"--runtime-env-json={json.dumps(runtime_env)}", *args[4:]]
    args[-1] = f"storage.uri=s3://{bucket}/job-recipe"
    args += [f"storage.endpoint={s3_server.endpoint}", "trainer.max_steps=20",
             "cluster.cpus_per_worker=0.5"]
    job = subprocess.run(args, cwd=user_project(tmp_path), env=env, capture_output=True,
                         text=True, timeout=600)
    out = job.stdout + job.stderr
    assert job.returncode == 0, out[-4000:]
    assert "succeeded in" in out and s3_server.secret_key not in out
    printed = [line for line in out.splitlines() if "run record: s3://" in line]
    assert printed and printed[-1].endswith("(this job's working folder is Ray's temporary copy)")
    uri = printed[-1].split("run record: ")[1].split(" ")[0]
    assert uri.startswith(f"s3://{bucket}/job-recipe/ddp-digits-") and "/records/" in uri
    stored = json.loads(s3_server.filesystem().open_input_stream(uri[len("s3://"):]).read())
    assert stored["status"] == "succeeded" and stored["steps"] == 20
