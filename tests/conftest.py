"""Shared fixtures: the command line as a subprocess, one real Ray head for the session
(replaced after a test that used it failed), one S3 server for the session. Helpers more
than one module uses are in tests/helpers.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.config.schema import FailureConfig
from scripts.local_cluster import (  # noqa: F401  (re-exported for the test modules)
    RayHead,
    add_node,
    answers,
    clean_env,
    free_port,
    start_head,
    stop_cluster,
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


# A worker keeps a process ready for its replacement (failure.spare_after_s, 10 s into its
# group): ~2-3 CPU-s each, paid by every run that lasts that long. Most tests' runs never
# restart, so their commands keep none; the tests of a restart keep the default (KEEP_SPARES),
# and test_faults checks the spares themselves (used by the restart, gone with the job).
NO_SPARES = "failure.spare_after_s=null"
KEEP_SPARES = f"failure.spare_after_s={FailureConfig.spare_after_s}"  # whatever the default is


def cli_command(run_dir: Path, *overrides: str, flags: tuple[str, ...] = ()) -> list[str]:
    if not any("failure.spare_after_s=" in o for o in overrides):
        overrides = (*overrides, NO_SPARES)
    # Hydra's argparse wants its flags before the overrides.
    return [sys.executable, "-m", "orchestrator", *flags, f"hydra.run.dir={run_dir}", *overrides]


def cli_env(extra: dict | None = None) -> dict:
    return clean_env(extra)


_driver_server: list = []  # [process, socket folder] once started


def forked(cmd: list[str]) -> list[str]:
    """A `python -m orchestrator ...` command run by a child of tests/driver_server.py (its
    first imports done once for the session), through the fork server's client; the command
    itself where the server cannot start."""
    if cmd[1:3] != ["-m", "orchestrator"]:
        return cmd
    if not _driver_server:
        import tempfile

        folder = tempfile.mkdtemp(prefix="orchestrator-drivers-")  # 0700: clients send their env
        server = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "driver_server.py"), f"{folder}/server.sock"],
            env={**os.environ, "ORCHESTRATOR_FORK_PARENT": str(os.getpid())},
            stdin=subprocess.DEVNULL)
        _driver_server[:] = [server, folder]
    client = REPO / "orchestrator" / "ray_internals" / "fork_server" / "client.py"
    return [sys.executable, "-I", str(client), f"{_driver_server[1]}/server.sock", *cmd[1:]]


def stop_driver_server() -> None:
    if _driver_server:
        import shutil

        server, folder = _driver_server
        server.kill()
        server.wait()
        shutil.rmtree(folder, ignore_errors=True)
        _driver_server.clear()


def run_cli(run_dir: Path, *overrides: str, env: dict | None = None, timeout: float = 600,
            flags: tuple[str, ...] = (), cwd: Path = REPO) -> CliResult:
    proc = subprocess.run(forked(cli_command(run_dir, *overrides, flags=flags)), cwd=cwd,
                          env=cli_env(env), capture_output=True, text=True, timeout=timeout)
    return CliResult(proc.returncode, proc.stdout, proc.stderr, run_dir)


class CliBatch:
    """The commands of one parametrized test, started side by side on first use, each forked
    from one process that imported what they all import first (tests/cli_runner.py: mostly
    imports, ~3.5 CPU-seconds a command otherwise), so that on 2 cores the batch takes a
    fraction of the time of running them in turn. Each case still asserts on its own result,
    and its wall time (from the batch's start) is kept for tests that bound it."""

    def __init__(self, base: Path, cases: dict, cwd: Path = REPO, env: dict | None = None,
                 local_storage: bool = True, timeout: float = 180):
        """cases: {key: overrides}; each case gets storage.uri=<its own folder>, unless
        local_storage is False (the cases name their own storage)."""
        self.base, self.cases, self.cwd, self.env, self.timeout = base, cases, cwd, env, timeout
        self.local_storage = local_storage
        self.folders = {key: base / f"case{i}" for i, key in enumerate(cases)}
        self.results: dict | None = None
        self.seconds: dict = {}

    def storage(self, key) -> Path:
        return self.folders[key] / "ckpt"

    def result(self, key) -> CliResult:
        if self.results is None:
            self.results = self._run()
        return self.results[key]

    def _run(self) -> dict:
        """The cases forked from one process that imported what they all import first
        (tests/cli_runner.py), side by side."""
        self.base.mkdir(parents=True, exist_ok=True)
        commands, keys = {}, {}
        for i, (key, overrides) in enumerate(self.cases.items()):
            folder = self.folders[key]
            folder.mkdir(parents=True, exist_ok=True)
            storage = [f"storage.uri={self.storage(key)}"] if self.local_storage else []
            argv = cli_command(folder / "run", *storage, *overrides)[3:]  # after `python -m orchestrator`
            commands[str(i)] = {"argv": argv, "stdout": str(folder / "stdout"),
                                "stderr": str(folder / "stderr")}
            keys[str(i)] = key
        spec = self.base / "batch.json"
        spec.write_text(json.dumps({"commands": commands}))
        runner = subprocess.Popen([sys.executable, str(REPO / "tests" / "cli_runner.py"), str(spec)],
                                  cwd=self.cwd, env=cli_env(self.env), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        _started.append(runner)
        out, err = runner.communicate(timeout=self.timeout)
        assert runner.returncode == 0, err[-3000:]
        ended = json.loads(out.strip().splitlines()[-1])
        results = {}
        for i, key in keys.items():
            code, self.seconds[key] = ended[i]
            folder = self.folders[key]
            results[key] = CliResult(code, (folder / "stdout").read_text(),
                                     (folder / "stderr").read_text(), folder / "run")
        return results


def read_record(run_dir) -> dict:
    """The run record as it stands (empty before the run wrote one)."""
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


_started: list[subprocess.Popen] = []


def start_run(run_dir, *overrides, cwd=REPO, env=None, flags: tuple[str, ...] = ()) -> subprocess.Popen:
    """The command, running: a test acts on it (kills, preempts) while it goes. Whatever the
    test leaves running is stopped when it ends (stop_started_runs)."""
    proc = subprocess.Popen(forked(cli_command(run_dir, *overrides, flags=flags)), cwd=cwd,
                            env=cli_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    _started.append(proc)
    return proc


def finish_run(proc: subprocess.Popen, run_dir: Path, timeout: float = 600) -> CliResult:
    """What a command start_run started ended with (its stderr is in its stdout)."""
    out, _ = proc.communicate(timeout=timeout)
    return CliResult(proc.returncode, out, "", run_dir)


@pytest.fixture(autouse=True)
def stop_started_runs():
    """A failed test's run must not outlive it: on a shared Ray head it would hold its workers'
    CPUs, and every later test would wait for them. Ctrl-C first (the run stops its workers),
    then SIGKILL (Ray removes a dead driver's actors)."""
    yield
    # The test modules import this file as tests.conftest, pytest as conftest: two modules.
    from tests.conftest import _started as started

    while started:
        proc = started.pop()
        if proc.poll() is not None:
            continue
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def wait_for(predicate, run_dir, timeout=240, every_s=0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        rec = read_record(run_dir)
        if rec and predicate(rec):
            return rec
        time.sleep(every_s)
    raise AssertionError(f"timed out; record: {read_record(run_dir)}{log_tails(run_dir)}")


def log_tails(run_dir, lines=30) -> str:
    """The end of each rank's log in the run folder: what a timed-out wait was waiting on."""
    tails = []
    for path in sorted((Path(run_dir) / "logs").glob("*.log")):
        text = path.read_text(errors="replace").splitlines()[-lines:]
        tails.append(f"\n--- {path.name}:\n" + "\n".join(text))
    return "".join(tails)


def user_project(tmp_path: Path) -> Path:
    """A copy of tests/user_project (a user's own package, mypkg) outside the repository."""
    import shutil

    target = tmp_path / "project"
    shutil.copytree(REPO / "tests" / "user_project", target,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return target


def cpus_in_use(head: RayHead) -> float | None:
    """The head's CPUs held by anything (its dashboard's view, refreshed every few seconds);
    None when it cannot say."""
    import urllib.request

    request = urllib.request.Request(f"{head.dashboard}/api/cluster_status")
    token = Path.home() / ".ray" / "auth_token"
    if token.exists():
        request.add_header("Authorization", f"Bearer {token.read_text().strip()}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            status = json.loads(response.read())
        return status["data"]["clusterStatus"]["loadMetricsReport"]["usage"]["CPU"][0]
    except (OSError, KeyError, TypeError, ValueError):
        return None


def cpus_come_free(head: RayHead, wait_s: float = 20) -> bool:
    """Whether what the tests before left on the head (a worker that outlived its run holds
    its CPUs) lets go of every CPU: the next test must not wait on it (seen: a run that asked
    for both CPUs waited 300 s for one a killed MWMS job never gave back). The view refreshes
    every ~5 s; past a few refreshes a new head (~8 s) is cheaper than waiting on (a clean
    clone's run spent 68 s in one test's setup: 60 s of waiting, then the new head anyway)."""
    deadline = time.monotonic() + wait_s
    while (used := cpus_in_use(head)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return not used


class SharedHead:
    """The session's Ray head, replaced before its next use when a test that used it failed
    or it no longer answers: one failure must not fail the tests after it (a broken head
    failed every later run on it)."""

    def __init__(self, tmp_path_factory):
        self.factory = tmp_path_factory
        self.head: RayHead | None = None
        self.suspect = False  # a test that used it failed

    def healthy(self) -> RayHead:
        if self.head is not None and (self.suspect or self.head.process.poll() is not None
                                      or not answers(self.head.address)
                                      or not cpus_come_free(self.head)):
            stop_cluster(self.head)
            self.head = None
        if self.head is None:
            self.head = start_head(self.factory.mktemp("ray-head"))
            self.suspect = False
        return self.head

    def stop(self) -> None:
        if self.head is not None:
            stop_cluster(self.head)
            self.head = None


@pytest.fixture(scope="session")
def shared_head(tmp_path_factory):
    holder = SharedHead(tmp_path_factory)
    yield holder
    holder.stop()


@pytest.fixture
def ray_head(shared_head):
    """One real Ray head for every test that joins a running cluster (tests that kill or add
    nodes start clusters of their own), checked before each test that uses it."""
    return shared_head.healthy()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and "ray_head" in getattr(item, "fixturenames", ()):
        holder = item.funcargs.get("shared_head") if hasattr(item, "funcargs") else None
        if holder is not None:
            holder.suspect = True
    return report


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real SeaweedFS S3 server on free loopback ports, stopped by pid afterwards."""
    from scripts.s3_server import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("seaweed")).start()
    yield server
    server.stop(kill=True)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server (SQLite store, artifacts through it) on a free loopback
    port, its process group stopped afterwards."""
    from scripts.mlflow_server import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def bucket(s3_server):
    s3_server.filesystem().create_dir("ckpt-tests")
    return "ckpt-tests"


# pytest's own process imports Ray, pyarrow's S3 and gRPC for the in-process tests; their
# exit handlers and static destructors can crash the process after the suite's verdict is
# printed (a clean clone's `make test` once ended "Segmentation fault" after "1 failed, 789
# passed"; pyarrow's S3 is known for it), turning a verdict into a crash. Once every fixture
# is finalized (its servers and clusters stopped by pid) and every plugin unconfigured, the
# suite ends with pytest's exit code and nothing after.
_exit_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _exit_status[:] = [int(exitstatus)]
    from tests.conftest import stop_driver_server as stop  # the module the tests imported

    stop()
    stop_driver_server()  # and pytest's own copy of this file, if a fixture of it started one


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if _exit_status and not hasattr(config, "workerinput"):
        import logging
        import os

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[0])
