"""cluster.keep_alive: a service keeps the first command's Ray and driver, and processes ready
for the next command's actors (orchestrator/service/). Real Ray (the session's head), real
commands from two folders outside the repository, each its own copy of a user's package."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from orchestrator.service.client import keep_alive_asked
from tests.conftest import cli_env, finish_run, run_cli, start_run, user_project, wait_for
from tests.helpers import assert_input_error, of_raylet, raylet_of

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


def job_processes(job: str, raylet: int | None) -> list[int]:
    """The job's processes on this raylet (another Ray's jobs have the same ids), but Ray's
    AutoscalingCoordinator: a detached actor, which a joined cluster keeps for every job after
    the first one's end (as after a plain command)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes() if entry.name.isdigit() else b""
            if f"RAY_JOB_ID={job}".encode() in environ.split(b"\0") and \
                    of_raylet(environ, raylet) and \
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
    raylet = raylet_of(ray_head.address)
    assert raylet is not None, ray_head.address
    while job_processes(ready["job"], raylet) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = job_processes(ready["job"], raylet)
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
    from orchestrator.private_dir import NotPrivateError
    from orchestrator.service.place import SERVICE_DIR, service_dir

    folder = tmp_path / "svc"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    monkeypatch.setenv(SERVICE_DIR, str(folder))
    with pytest.raises(NotPrivateError, match="not this user's alone"):
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


# Run as root: binds (or makes its socket) as root, then becomes another user before it listens
# (or connects), so the kernel records that user for the peer; what it received is printed.
AS_ANOTHER_USER = """
import os, socket, sys
role, path, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
if role == "listen":
    sock.bind(path)
os.setgid(uid)
os.setuid(uid)
if role == "listen":
    sock.listen(1)
    print("listening", flush=True)
    sock, _ = sock.accept()
    print("accepted", flush=True)
else:
    sock.connect(path)
sock.settimeout(10)
received = 0
try:
    if role == "connect":
        sock.sendall(b'{"stop": true}\\n')  # the service may have closed it already
    while chunk := sock.recv(65536):
        received += len(chunk)
except OSError:
    pass
print(received, flush=True)
"""
NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root, to act as another user")


def socket_in(folder: Path) -> Path:
    from orchestrator.service.place import service_name

    return folder / f"service-{service_name()}.sock"


def as_user(role: str, path: Path, uid: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", AS_ANOTHER_USER, role, str(path), str(uid)],
                            stdout=subprocess.PIPE, text=True)


def listening(path: Path, uid: int) -> subprocess.Popen:
    listener = as_user("listen", path, uid)
    assert listener.stdout.readline() == "listening\n"
    return listener


def ended_with(process: subprocess.Popen) -> list[str]:
    """What it printed, once ended (killed where it still waits)."""
    try:
        out, _ = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
    return out.split()


@pytest.fixture
def own_handlers():
    """hand_over relays the signals, Service.serve sets SIGINT's: pytest's are put back."""
    saved = {signum: signal.getsignal(signum)
             for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.fixture
def no_service_started(monkeypatch):
    """A command that would start a real service (or wait for one to go) runs on its own."""
    from orchestrator.service import client

    monkeypatch.setattr(client, "start_service", lambda *where: None)
    monkeypatch.setattr(client, "wait_gone", lambda *where: None)


def test_a_service_folder_that_is_a_link_or_a_file_is_refused_before_anything_is_sent(
        tmp_path, monkeypatch, capsys, own_handlers, no_service_started):
    from orchestrator.service.client import hand_over
    from orchestrator.service.place import SERVICE_DIR

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    listener = listening(socket_in(real), os.getuid())  # a service there, of this user's
    monkeypatch.setenv(SERVICE_DIR, str(tmp_path / "link"))
    assert hand_over(["cluster.keep_alive=60"], 0.0) is None
    listener.kill()
    assert "accepted" not in ended_with(listener)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"cluster.keep_alive: {tmp_path / 'link'} is not this user's alone (it is a "
                   f"symbolic link); set {SERVICE_DIR} to a folder of your own; this command "
                   "runs on its own"], err

    (tmp_path / "file").write_text("")
    monkeypatch.setenv(SERVICE_DIR, str(tmp_path / "file"))
    assert hand_over(["cluster.keep_alive=60"], 0.0) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(it is not a directory)" in err[0], err


def test_the_socket_and_the_log_are_never_followed_through_a_link(tmp_path):
    from orchestrator.service.client import open_log
    from orchestrator.service.place import connect

    elsewhere = tmp_path / "elsewhere.sock"
    listener = listening(elsewhere, os.getuid())
    (tmp_path / "service.sock").symlink_to(elsewhere)
    assert connect(tmp_path / "service.sock") is None
    listener.kill()
    assert "accepted" not in ended_with(listener)

    target = tmp_path / "someone-elses-file"
    target.write_text("theirs\n")
    (tmp_path / "service.log").symlink_to(target)
    with pytest.raises(OSError, match="symbolic links"):
        open_log(tmp_path / "service.log")
    assert target.read_text() == "theirs\n"


@as_root
def test_a_listener_of_another_user_is_refused_before_anything_is_sent(
        tmp_path, monkeypatch, capsys, own_handlers, no_service_started):
    from orchestrator.service.client import hand_over
    from orchestrator.service.place import SERVICE_DIR

    folder = tmp_path / "svc"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv(SERVICE_DIR, str(folder))
    listener = listening(socket_in(folder), NOBODY)
    assert hand_over(["cluster.keep_alive=60"], 0.0) is None
    assert ended_with(listener) == ["accepted", "0"]  # connected, then closed: nothing sent
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"cluster.keep_alive: the service's socket {socket_in(folder)} is held by "
                   f"uid {NOBODY}, not by this user; remove it, or set {SERVICE_DIR} to a "
                   "folder of your own; this command runs on its own"], err


@as_root
def test_the_service_drops_a_client_of_another_user_unanswered(monkeypatch):
    import tempfile
    import threading

    from orchestrator.service import server
    from orchestrator.service.place import Reader, send

    folder = Path(tempfile.mkdtemp(prefix="svc-"))  # under /tmp: another user can reach it
    monkeypatch.setenv("ORCHESTRATOR_SERVICE_DIR", str(folder))
    service = server.Service()
    try:
        # The folder's and the socket's modes are the first lock: opened here to reach the
        # second, the peer's uid.
        folder.chmod(0o711)
        service.path.chmod(0o666)
        accepting = threading.Thread(target=service.accept, daemon=True)
        accepting.start()
        assert ended_with(as_user("connect", service.path, NOBODY)) == ["0"]
        assert accepting.is_alive()  # its stop was not taken
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mine:  # this user's: answered
            mine.connect(str(service.path))
            send(mine, {"stop": True})
            assert Reader(mine).next() == {"stopping": os.getpid()}
        accepting.join(timeout=10)
        assert not accepting.is_alive()
    finally:
        service.listener.close()
        shutil.rmtree(folder)


def umask_now() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def terminal_now() -> list[tuple[int, int]]:
    return [(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (0, 1, 2)]


def serve_one(service, cwd: Path, umask: int) -> tuple[list[dict], bytes]:
    """A command handed to ``service`` as a client hands it (its stdin, stdout and stderr, the
    last two a pipe read here): the service's replies, and what the command wrote."""
    from orchestrator.service import server
    from orchestrator.service.place import Reader

    client, conn = socket.socketpair()
    output, into = os.pipe()
    fds = [os.open(os.devnull, os.O_RDONLY), into, os.dup(into)]
    request = {"argv": ["trainer=function"], "cwd": str(cwd), "umask": umask,
               "env": {**os.environ, "SERVED": "yes"}, "started_at": 0.0, "keep_alive_s": 60}
    service.serve(server.Command(conn, Reader(conn), request, fds))
    reader = Reader(client)
    replies = [reader.next(), reader.next()]  # "started", then the last one, as a command does
    client.close()  # which ends the service's relay of its signals
    with os.fdopen(output, "rb") as pipe:  # every copy of its other end is closed by now
        return replies, pipe.read()


def test_a_command_whose_folder_cannot_be_entered_gets_one_error_line_and_the_next_runs(
        tmp_path, monkeypatch, own_handlers):
    """Set up and put back step by step: a failed chdir leaves the service's folder, terminal,
    environment and umask as they were, and the next command runs with its own folder and
    umask (the service's are back after it too)."""
    import ray  # noqa: F401  (sets RAY_CLIENT_MODE as it imports: the service has it too)

    from orchestrator.service import server

    monkeypatch.setenv("ORCHESTRATOR_SERVICE_DIR", str(tmp_path / "svc"))
    service = server.Service()
    service.held = types.SimpleNamespace(folder=None, session=None)  # no Ray: no actors
    ran = []

    def run_command(request):
        ran.append((os.getcwd(), umask_now(), os.environ.get("SERVED")))
        os.write(1, b"the command's output\n")
        return 0

    monkeypatch.setattr(server, "run_command", run_command)
    monkeypatch.setattr(server, "reset_logging", lambda: None)  # pytest's log capture stays
    own_umask = os.umask(0o022)
    try:
        before = (os.getcwd(), terminal_now(), dict(os.environ), umask_now())
        replies, output = serve_one(service, tmp_path / "gone", 0o077)
        assert replies[1:] == [{"error": f"the service cannot enter the command's folder "
                                         f"{tmp_path / 'gone'} (No such file or directory); run "
                                         "it from a folder that exists and that you can enter"}]
        assert not ran and output == b""
        assert (os.getcwd(), terminal_now(), dict(os.environ), umask_now()) == before

        (tmp_path / "here").mkdir()
        replies, output = serve_one(service, tmp_path / "here", 0o077)
        assert replies[1:] == [{"exit": 0}]
        assert ran == [(str(tmp_path / "here"), 0o077, "yes")]
        assert output == b"the command's output\n"
        assert (os.getcwd(), terminal_now(), dict(os.environ), umask_now()) == before
    finally:
        os.umask(own_umask)
        service.listener.close()


def test_a_command_hands_its_umask_over_and_prints_the_services_error_line(
        tmp_path, monkeypatch, capsys, own_handlers, no_service_started):
    import threading

    from orchestrator.service.client import hand_over
    from orchestrator.service.place import SERVICE_DIR, Reader, send

    folder = tmp_path / "svc"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv(SERVICE_DIR, str(folder))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_in(folder)))
    listener.listen(1)
    received = []

    def a_service_that_cannot_enter_the_folder() -> None:
        conn, _ = listener.accept()
        with conn:
            reader = Reader(conn)
            received.append(reader.next())
            for fd in reader.fds:
                os.close(fd)
            send(conn, {"started": 1})
            send(conn, {"error": "the service cannot enter the command's folder /gone"})

    serving = threading.Thread(target=a_service_that_cannot_enter_the_folder, daemon=True)
    serving.start()
    own_umask = os.umask(0o027)
    try:
        code = hand_over(["cluster.keep_alive=60"], 0.0)
    finally:
        os.umask(own_umask)
        serving.join(timeout=10)
        listener.close()
    assert code == 1 and received[0]["umask"] == 0o027
    assert capsys.readouterr().err.splitlines() == [
        "error: the service cannot enter the command's folder /gone"]
