"""cluster.keep_alive: a service keeps the first command's Ray and driver, and processes ready
for the next command's actors (orchestrator/service/). Real Ray (the session's head), real
commands from two folders outside the repository, each its own copy of a user's package."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.service.client import keep_alive_asked
from tests.conftest import cli_env, finish_run, run_cli, start_run, user_project, wait_for
from tests.helpers import assert_input_error

READY = re.compile(r"kept alive: (\d+) of the run's (\d+) actors started in processes kept ready")

# The second folder's package leaves a file named after each process that imports it.
MARKER = '''
import os as _os
from pathlib import Path as _Path

(_Path(__file__).parent.parent / f"imported-by-{_os.getpid()}").touch()
'''


def service(env: dict, command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.service", command],
                          env=cli_env(env), capture_output=True, text=True, timeout=120)


def status(env: dict) -> dict | None:
    done = service(env, "status")
    return json.loads(done.stdout) if done.returncode == 0 else None


def wait_status(env: dict, ready, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = status(env)
        if now and ready(now):
            return now
        time.sleep(0.5)
    raise AssertionError(f"the service never got there: {status(env)}")


def job_processes(job: str) -> list[int]:
    """The job's processes, but Ray's AutoscalingCoordinator: a detached actor, which a joined
    cluster keeps for every job after the first one's end (as after a plain command)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"RAY_JOB_ID={job}".encode() in \
                    (entry / "environ").read_bytes().split(b"\0") and \
                    b"AutoscalingCoordinator" not in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.fixture
def service_env(tmp_path):
    env = {"ORCHESTRATOR_SERVICE_DIR": str(tmp_path / "svc")}
    yield env
    running = status(env)
    service(env, "stop")
    if running:  # a service that did not stop is ended by its pid
        try:
            os.kill(running["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_kept_alive_service_runs_the_next_commands_in_processes_it_kept_ready(
        ray_head, tmp_path, service_env):
    first, second = user_project(tmp_path / "a"), user_project(tmp_path / "b")
    init = second / "mypkg" / "__init__.py"
    init.write_text(init.read_text() + MARKER)
    common = ["trainer=function", "trainer.fn=mypkg.train:main", "+trainer.steps=40",
              f"cluster.address={ray_head.address}", "cluster.keep_alive=120",
              "cluster.cpus_per_worker=0.5", f"storage.uri={tmp_path / 'ckpt'}"]

    a = run_cli(tmp_path / "run-a", *common, "run.name=a", env=service_env, cwd=first)
    assert a.returncode == 0, a.output[-4000:]
    # The recorder, Ray Train's controller (with the group's barrier: no actor for it) and the
    # two workers.
    started, actors = READY.search(a.output).groups()
    assert started == "0" and int(actors) == 4, a.output[-2000:]
    ready = wait_status(service_env,
                        lambda s: not s["preparing"] and s["ready_processes"] >= int(actors))
    assert ready["busy"] is False and ready["job"]

    # From another folder: its own package, on the driver and on the workers; every actor of the
    # run starts in a process the service kept ready.
    b = run_cli(tmp_path / "run-b", *common, "run.name=b", env=service_env, cwd=second)
    assert b.returncode == 0, b.output[-4000:]
    assert READY.search(b.output).groups() == (actors, actors), b.output[-2000:]
    assert b.record["status"] == "succeeded" and b.record["steps"] == 40
    importers = {int(p.name.rsplit("-", 1)[1]) for p in second.glob("imported-by-*")}
    assert ready["pid"] in importers, importers  # the service's trial of the parts
    assert importers - {ready["pid"]}, "the workers did not import the second folder's package"
    assert not list(first.glob("imported-by-*"))
    assert status(service_env)["pid"] == ready["pid"]  # one service served both

    # Bad input through the service: one line, exit 2, as on its own.
    bad = run_cli(tmp_path / "run-bad", *common, "cluster.workers=0", env=service_env, cwd=second)
    assert_input_error(bad, "cluster.workers")

    # A command that asks for another Ray runs on its own (here its parts fail their trial).
    own = run_cli(tmp_path / "run-own", "trainer.model._target_=mypkg.bad_parts.FiveByTwo",
                  *common[3:], "log.ray_verbose=true", env=service_env, cwd=second)
    assert own.returncode == 2, own.output[-3000:]
    assert "cluster.keep_alive: the service's Ray was started with other settings: " \
        "log.ray_verbose=true (the service's: false)" in own.stderr, own.stderr
    assert own.stderr.strip().splitlines()[-1].startswith("error: trainer.loss: on the model")

    # Ctrl-C reaches the served run: the run stops as a plain one does; the service goes on.
    wait_status(service_env, lambda s: not s["preparing"])
    long = start_run(tmp_path / "run-long", *common[:2], "+trainer.steps=100000", *common[3:],
                     "run.name=long", env=service_env, cwd=second)
    wait_for(lambda rec: rec.get("steps", 0) > 0, tmp_path / "run-long")
    long.send_signal(signal.SIGINT)
    stopped = finish_run(long, tmp_path / "run-long", timeout=120)
    assert stopped.returncode == 130, stopped.output[-3000:]
    assert stopped.record["status"] == "interrupted"
    assert status(service_env)["pid"] == ready["pid"]

    # `stop` ends the service and its job: no process of that job is left.
    done = service(service_env, "stop")
    assert done.returncode == 0 and f"service {ready['pid']} stopped" in done.stdout, done
    assert status(service_env) is None
    assert not list(Path(service_env["ORCHESTRATOR_SERVICE_DIR"]).glob("*.sock"))  # no stale file
    deadline = time.monotonic() + 60
    while job_processes(ready["job"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = job_processes(ready["job"])
    assert not left, [Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in left]


@pytest.mark.parametrize("argv,seconds", [
    (["cluster.keep_alive=600"], 600.0),
    (["cluster.keep_alive=600", "cluster.keep_alive=0"], None),  # the last one counts
    (["++cluster.keep_alive=30"], 30.0),
    (["cluster.keep_alive=soon"], None),  # left to the checks: one line, exit 2
    (["cluster.keep_alive=inf"], None),  # so are values beyond what a service can wait
    (["cluster.keep_alive=2592000"], 2592000.0),
    (["--multirun", "cluster.keep_alive=600", "trainer.lr=0.1,0.2"], None),  # a sweep: its own
    (["--cfg", "job", "cluster.keep_alive=600"], None),
    ([], None),
])
def test_which_commands_are_handed_to_a_service(argv, seconds):
    assert keep_alive_asked(argv) == seconds


def test_a_service_folder_of_another_user_or_open_to_others_is_refused(tmp_path, monkeypatch):
    from orchestrator.service.place import SERVICE_DIR, ServiceError, service_dir

    folder = tmp_path / "svc"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    monkeypatch.setenv(SERVICE_DIR, str(folder))
    with pytest.raises(ServiceError, match="not this user's alone"):
        service_dir()
    folder.chmod(0o700)
    assert service_dir() == folder


def test_stop_waits_for_the_services_end_not_for_its_zombie_to_be_reaped():
    """A service whose end no process waits for (re-parented to one that never waits) stays a
    zombie: ended all the same."""
    from orchestrator.service.__main__ import wait_stopped

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    while Path(f"/proc/{ended.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        time.sleep(0.05)
    started = time.monotonic()
    wait_stopped(ended.pid, timeout_s=30)
    assert time.monotonic() - started < 5
    ended.wait()



def test_a_served_commands_variables_reach_its_workers_and_other_credentials_are_not_served(
        monkeypatch):
    """The service's Ray processes have the environment of the command that started it: a
    later command's HF_TOKEN or AWS keys did not reach its workers, the first one's did."""
    from orchestrator.service import served_env

    first = {"HOME": "/root", "AWS_ACCESS_KEY_ID": "AKIAFIRST", "AWS_SECRET_ACCESS_KEY": "s1",
             "OMP_NUM_THREADS": "1"}
    monkeypatch.setattr(served_env, "ray_started_with", first)
    assert served_env.credentials_differ(first) == []
    second = {"HOME": "/root", "AWS_PROFILE": "prod", "HF_TOKEN": "hf_second"}
    assert served_env.credentials_differ(second) == [
        "AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"]
    # a URL with a password is a credential too, whatever its name
    assert served_env.credentials_differ({**first, "DATABASE_URL": "postgres://u:pw@db/x"}) == \
        ["DATABASE_URL"]
    monkeypatch.setattr(os, "environ", {**first, "MY_FLAG": "2", "OMP_NUM_THREADS": "4",
                                        "CUDA_VISIBLE_DEVICES": "0", "RAY_ADDRESS": "x",
                                        "SSH_CONNECTION": "10.0.0.1 5 10.0.0.2 22"})
    assert served_env.for_workers() == {"MY_FLAG": "2", "OMP_NUM_THREADS": "4"}
    monkeypatch.setattr(served_env, "ray_started_with", None)  # a plain command: nothing
    assert served_env.for_workers() == {} and served_env.credentials_differ(second) == []
