"""What a user watches: progress, Ray metrics on Prometheus, TensorBoard curves, a clean log.

Pure pieces first; then two real runs on an embedded Ray (cluster=local): a default run with a
worker killed mid-way (metrics scraped while it goes, curves across the restart, the non-TTY
output), and a log.ray_verbose run that brings Ray's own lines back.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.driver.record import RunRecord
from orchestrator.observe.curves import Curves
from orchestrator.observe.progress import ProgressState, bar_line, clock, progress_line
from orchestrator.observe.rate import Rate
from orchestrator.ray_internals.head_start import DASHBOARD_DEFER_MAX_S
from orchestrator.storage.location import StorageSpec
from scripts.benchmarks.proctree import cmdline, descendants, start_time
from tests.conftest import (
    REPO,
    _started,
    cli_command,
    cli_env,
    free_port,
    read_record,
    wait_for,
)
from tests.helpers import embedded_token_auth, token_headers

# Ray's own lines that used to fill the terminal (see NOTES.md), by the patterns they carry.
RAY_NOISE = [r"\(RayTrainWorker pid=\d+", r"\(TrainController pid=\d+", r"PlacementGroupCleaner",
             r"Token authentication is enabled", r"Setting up process group",
             r"Started training worker group", r"core_worker\.cc", r"\(pid=\d+"]
PROGRESS = re.compile(r"\[orchestrator\]\[INFO\] - step (\d+)/(\d+) \(\d+%\) \| ETA \d+:\d\d \| "
                      r"[\d,]+ samples/s \| 2 workers \| loss=[\d.e-]+ \| [\d.e-]+ s/step$", re.M)


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Read the event files back with TensorBoard's own loader, in its no-TensorFlow mode
    (what its `notf` build does), so the test does not pay for importing TensorFlow."""
    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# -- pure pieces -----------------------------------------------------------------------------

def test_rate_is_over_the_window_and_restarts_with_a_group():
    rate = Rate(window_s=10)
    assert rate.samples_per_s() is None and rate.step_s() is None
    for i in range(30):  # 64 samples per step, 10 steps per second
        rate.add(100 + i * 0.1, i + 1, 64)
    assert rate.samples_per_s() == pytest.approx(640) and rate.step_s() == pytest.approx(0.1)
    rate.add(200.0, 31, 64)  # long after: only the last window counts
    rate.add(201.0, 41, 640)
    assert rate.samples_per_s() == pytest.approx(640) and rate.step_s() == pytest.approx(0.1)
    rate.reset()
    assert rate.samples_per_s() is None


def test_progress_line_and_bar():
    state = ProgressState(step=110, total=220, world_size=2, samples_per_s=1830.4, step_s=0.035,
                          metrics={"loss": 0.21345, "acc": 0.9})
    assert progress_line(state) == ("step 110/220 (50%) | ETA 0:04 | 1,830 samples/s | "
                                    "2 workers | loss=0.2135 | 0.035 s/step")
    bar = bar_line(state, "round", width=200)
    assert bar.startswith("round 110/220 [" + "=" * 10 + ">" + " " * 9 + "]  50% | ETA 0:04 |")
    assert bar_line(ProgressState(step=220, total=220), width=200).startswith(
        "step 220/220 [" + "=" * 20 + "] 100%")
    assert len(bar_line(state, width=40)) <= 39  # never wraps on a narrow terminal
    assert progress_line(ProgressState(step=5)) == "step 5"
    # A user's script counts checkpoints, and no samples: no "0 samples/s"
    assert progress_line(ProgressState(step=4, world_size=2, samples_per_s=0.0, step_s=0.5),
                         "checkpoint") == "checkpoint 4 | 2 workers | 0.5 s/checkpoint"
    assert clock(3725) == "1:02:05" and clock(65) == "1:05"
    # A coordinator (trainer=tf_ps) is Ray Train's one worker: its own words for its processes
    assert progress_line(ProgressState(step=4, world_size=1, workers_shown="3 workers, 1 "
                                       "parameter server")) == "step 4 | 3 workers, 1 parameter server"


def test_record_says_why_a_group_started():
    rec = RunRecord("r", "ddp", {}, "/ck", started_at=0.0)
    assert rec.group_started(4, 0, 1.0, total_steps=500) == "start"
    assert rec.group_started(4, 0, 2.0) == "restart" and rec.total_steps == 500
    assert rec.group_started(2, 0, 3.0) == "resize"
    rec.preemption_notice(0, 30.0, ["n1"], 4.0)
    assert rec.group_started(2, 0, 5.0) == "preemption"


def test_curves_keep_one_point_per_step_across_a_restart(tmp_path):
    curves = Curves(str(tmp_path / "tb"))
    for step in range(1, 41):
        curves.add(step, {"train/loss": 1.0 / step})
    for step in range(31, 61):  # restarted from the checkpoint at step 30
        curves.add(step, {"train/loss": 1.0 / step, "perf/samples_per_s": 100.0})
    curves.close()
    scalars = read_scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 61))
    assert [s for s, _ in scalars["perf/samples_per_s"]] == list(range(31, 61))
    assert scalars["train/loss"][59][1] == pytest.approx(1 / 60)


def test_curves_are_framed_as_tensorboards_own_writer_frames_them(tmp_path):
    """curves.py writes TFRecord frames itself (TensorBoard's writer imports numpy and more
    into the recorder's process): the same bytes, checksums included."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    from orchestrator.observe.curves import crc32c, record

    assert crc32c(b"123456789") == 0xE3069283  # CRC-32C's check value
    payloads = [b"", b"\x00", bytes(range(256)) * 5, Curves.__doc__.encode()]
    with open(tmp_path / "theirs", "wb") as theirs:
        writer = RecordWriter(theirs)
        for payload in payloads:
            writer.write(payload)
    assert b"".join(record(p) for p in payloads) == (tmp_path / "theirs").read_bytes()


def test_the_observing_core_imports_no_framework():
    code = ("import sys, orchestrator.driver.recorder, orchestrator.observe.curves, "
            "orchestrator.observe.metrics, orchestrator.observe.progress, orchestrator.driver.launch; "
            "print(sorted(m for m in ('torch', 'tensorflow', 'xgboost', 'lightgbm', 'tensorboardX')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_recorders_process_imports_neither_ray_train_nor_pandas():
    """The recorder's actor process starts on every run's path to its first step: what its
    class, the metrics it exports and the curves it writes import is all it pays (ray.train
    brings ray.data and pandas, ~0.5 CPU-s; TensorBoard's record writer numpy, boto3 and
    fsspec, ~0.4)."""
    code = ("import sys, orchestrator.driver.recorder, orchestrator.observe.metrics, "
            "orchestrator.observe.curves; print(sorted(m for m in ('ray.train', 'ray.data', "
            "'pandas', 'numpy', 'boto3', 'fsspec') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


# -- a real run, killed worker included ---------------------------------------------------------

def scrape(url: str, run_name: str) -> dict[str, float]:
    """The orchestrator's series of this run from a Prometheus endpoint: {sample name: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_orchestrator_") and s.labels.get("run") == run_name:
                assert s.labels.get("trainer") == "ddp", s
                key = s.name + (f"[{s.labels['metric']}]" if "metric" in s.labels else "")
                if "le" not in s.labels:
                    found[key] = s.value
    return found


SERIES = {f"ray_orchestrator_{name}" for name in (
    "step", "samples_per_s", "step_seconds", "world_size", "restarts", "preemptions",
    "lost_steps", "checkpoint_step", "train_metric[loss]", "checkpoint_save_seconds_count",
    "checkpoint_save_seconds_sum", "checkpoint_upload_seconds_count",
    "checkpoint_upload_seconds_sum")}


def http_status(url: str, headers: dict) -> int:
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code


class Beside:
    """A short default command run beside another on the same machine, asking for the same
    dashboard port, held at step 1 until its dashboard was seen."""

    def __init__(self, tmp_path: Path, dash: int):
        self.run_dir, self.out_path = tmp_path / "beside", tmp_path / "beside.txt"
        self.gate = tmp_path / "beside-gate"
        self.gate.touch()
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(
                cli_command(self.run_dir, f"storage.uri={tmp_path / 'ckpt-beside'}",
                            f"cluster.dashboard_port={dash}", "trainer.max_steps=4",
                            "trainer.fn=tests.user_trainers:gated_ddp", f"+trainer.gate={self.gate}",
                            "+trainer.hold_at=1", "+trainer.pace_s=0"),
                cwd=REPO, env=cli_env(), stdout=out, stderr=subprocess.STDOUT, text=True)
        self.returncode: int | None = None

    @property
    def output(self) -> str:
        return self.out_path.read_text()

    def check_its_dashboard(self, taken: int) -> None:
        deadline = time.monotonic() + 300
        found = None
        while found is None and time.monotonic() < deadline and self.proc.poll() is None:
            found = re.search(r"Ray dashboard: (http://127\.0\.0\.1:(\d+))", self.output)
            time.sleep(0.2)
        assert found, self.output[-3000:]
        assert int(found.group(2)) != taken, self.output[-3000:]
        status = None
        while status is None and time.monotonic() < deadline:
            try:
                status = http_status(f"{found.group(1)}/api/version", token_headers())
            except OSError:  # it starts once the workers have (head_start.py)
                time.sleep(0.2)
        assert status == 200, self.output[-3000:]
        self.gate.unlink()

    def end(self) -> None:
        self.gate.unlink(missing_ok=True)
        try:
            self.returncode = self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)
            self.returncode = self.proc.wait(timeout=60)


def socket_folders_left(since: float) -> list[str]:
    """This user's multiprocessing folders (pymp-* in the temporary folder) changed since
    ``since`` whose socket no process listens on any more: left behind."""
    import tempfile

    listening = {line.split()[-1] for line in Path("/proc/net/unix").read_text().splitlines()[1:]}
    left = []
    for folder in Path(tempfile.gettempdir()).glob("pymp-*"):
        try:
            info = folder.lstat()
            sockets = {str(path) for path in folder.iterdir()}
        except OSError:  # another's, or gone meanwhile
            continue
        if info.st_uid == os.getuid() and info.st_mtime >= since and not sockets & listening:
            left.append(str(folder))
    return left


def test_a_local_run_shows_metrics_curves_progress_and_no_ray_noise(tmp_path):
    run_dir, out_path, dash = tmp_path / "run", tmp_path / "out.txt", free_port()
    began = time.time() - 1
    gate = tmp_path / "gate"  # the run holds at step 3000 until the metrics showed the restart
    gate.touch()
    with open(out_path, "w") as out:  # a file, not a pipe: stdout is not a terminal
        proc = subprocess.Popen(
            cli_command(run_dir, f"storage.uri={tmp_path / 'ckpt'}", f"cluster.dashboard_port={dash}",
                        "trainer.epochs=150", "checkpoint.every_steps=100", "log.progress_every_s=2",
                        "trainer.fn=tests.user_trainers:gated_ddp", f"+trainer.gate={gate}",
                        "+trainer.hold_at=3000", "+trainer.pace_s=0"),
            cwd=REPO, env=cli_env(), stdout=out, stderr=subprocess.STDOUT, text=True)
    beside = None
    try:
        # A second command started beside it once it chose its dashboard's port (the dashboard
        # itself starts later, once the workers have), asking for the same port: it gets
        # another, prints it, and its dashboard answers there (it holds at step 1 until seen).
        deadline = time.monotonic() + 300
        while "Ray dashboard:" not in out_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        beside = Beside(tmp_path, dash)
        # (a generous wait: Ray's start-up alone took minutes on the shared 2-core machine)
        rec = wait_for(lambda r: r.get("checkpoints") and len(r.get("workers", [])) == 2, run_dir,
                       timeout=480)
        text = out_path.read_text()
        metrics_url = re.search(r"metrics: (http://\S+/metrics)", text).group(1)
        dashboard = re.search(r"Ray dashboard: (http://127\.0\.0\.1:\d+)", text).group(1)

        # The dashboard answers on loopback with the token it names, and on no other address.
        # (It starts beside the run, at the workers' priority: on a loaded machine it may come
        # up after the first checkpoint; the deadline is only a bound.)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", dash), timeout=5).close()
                break
            except OSError:
                time.sleep(0.2)
        # It started once the run's workers had (head_start.py), not beside Ray's start (or,
        # on a machine that slow, DASHBOARD_DEFER_MAX_S after it).
        dashboards = [pid for pid in descendants(proc.pid)
                      if "dashboard/dashboard.py" in cmdline(pid)
                      and f"--port={dash}" in cmdline(pid).split()]
        workers_born = max(int(start_time(w["pid"])) for w in rec["workers"])
        bound = int(start_time(proc.pid)) + DASHBOARD_DEFER_MAX_S * os.sysconf("SC_CLK_TCK")
        assert len(dashboards) == 1 and int(start_time(dashboards[0])) > min(workers_born, bound)
        beside.check_its_dashboard(dash)
        if embedded_token_auth():
            assert "ray get-auth-token" in text
            assert http_status(f"{dashboard}/api/version", token_headers()) == 200
            assert http_status(f"{dashboard}/api/version", {}) == 401
        else:
            assert http_status(f"{dashboard}/api/version", {}) == 200
        host = re.match(r"http://([^:/]+)", metrics_url).group(1)
        if host not in ("127.0.0.1", "localhost"):
            with pytest.raises(OSError):
                socket.create_connection((host, dash), timeout=5).close()

        os.kill(rec["workers"][1]["pid"], signal.SIGKILL)  # a forced restart
        wait_for(lambda r: r.get("restarts") == 1 and r["steps"] > r["world_sizes"][-1]["step"],
                 run_dir)
        # Ray exports every few seconds: scrape while the run holds until the restart shows
        # (however fast the machine: a run that ended first closed the endpoint with it).
        seen: dict[str, float] = {}
        deadline = time.time() + 180
        while proc.poll() is None and time.time() < deadline:
            try:
                seen = scrape(metrics_url, rec["run_name"])
            except OSError:  # the endpoint closes with Ray at the run's end
                if proc.poll() is not None or read_record(run_dir).get("status") != "running":
                    break
                raise
            if seen.get("ray_orchestrator_restarts") == 1 and SERIES <= seen.keys():
                break
            time.sleep(1)
        gate.unlink()  # the held run finishes
        assert proc.wait(timeout=600) == 0, out_path.read_text()[-4000:]
    finally:
        gate.unlink(missing_ok=True)
        if beside is not None:
            beside.end()
        if proc.poll() is None:  # Ctrl-C: the command stops its embedded Ray itself
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    output = out_path.read_text()
    rec = read_record(run_dir)
    assert rec["status"] == "succeeded" and rec["restarts"] == 1
    # The workers' preemption checks took one call per node (ray_internals/
    # preemption_agreement.py), not Ray's public calls: rank 0 would have warned.
    assert not [w for w in rec["warnings"] if "preemption checks" in w], rec["warnings"]

    # The default job (DDP on digits, 2 workers, an embedded Ray): trained, every checkpoint
    # committed, the newest 3 kept (checkpoint.keep) and the one the restart resumed from.
    assert rec["trainer"] == "ddp" and [w["size"] for w in rec["world_sizes"]] == [2, 2]
    assert rec["steps"] == 150 * (1437 // 64) and rec["metrics"]["test_accuracy"] > 0.9
    assert rec["samples_per_s"] > 0 and rec["time_to_first_step_s"] > 0
    kept = CheckpointStore(StorageSpec(str(tmp_path / "ckpt" / rec["run_name"]))).committed()
    newest = [c["step"] for c in rec["checkpoints"]][-3:]
    assert [r.step for r in kept] == sorted({rec["world_sizes"][1]["step"], *newest})
    assert kept[-1].step == rec["steps"]
    assert f"Ray dashboard: http://127.0.0.1:{dash}" in output and "test_accuracy=" in output
    assert "did not start" not in output + beside.output, beside.output[-3000:]
    assert beside.returncode == 0 and read_record(beside.run_dir)["status"] == "succeeded"
    assert str(run_dir / "run.json") in output
    # Issue 60, 4: neither embedded Ray left the folder of its dashboard's forkserver socket.
    assert socket_folders_left(began) == []

    # Metrics: every series, tagged by run and trainer, with sane values.
    assert seen.get("ray_orchestrator_restarts") == 1, f"the restart never showed: {seen}\n{output}"
    assert SERIES <= seen.keys(), SERIES - seen.keys()
    assert seen["ray_orchestrator_world_size"] == 2
    assert 0 < seen["ray_orchestrator_step"] <= rec["steps"]
    assert seen["ray_orchestrator_samples_per_s"] > 0 and 0 < seen["ray_orchestrator_step_seconds"] < 10
    assert seen["ray_orchestrator_preemptions"] == 0
    assert 0 <= seen["ray_orchestrator_lost_steps"] <= 100
    assert seen["ray_orchestrator_checkpoint_step"] % 100 == 0 and seen["ray_orchestrator_checkpoint_step"] > 0
    assert seen["ray_orchestrator_train_metric[loss]"] > 0
    for hist in ("checkpoint_save_seconds", "checkpoint_upload_seconds"):
        assert seen[f"ray_orchestrator_{hist}_count"] >= 1 and seen[f"ray_orchestrator_{hist}_sum"] >= 0

    # TensorBoard: one curve per tag across the restart, every step once, steps only going up.
    scalars = read_scalars(run_dir / "tensorboard")
    total, restart_step = rec["steps"], rec["world_sizes"][1]["step"]
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, total + 1))
    assert scalars["train/loss"][-1][1] < scalars["train/loss"][0][1]  # it learned
    for tag in ("perf/samples_per_s", "perf/step_seconds", "cluster/world_size"):
        steps = [s for s, _ in scalars[tag]]
        assert steps == sorted(set(steps)) and steps[-1] == total, tag
        assert any(s > rec["lost_steps"] + restart_step for s in steps), tag  # after the restart
    assert {v for _, v in scalars["cluster/world_size"]} == {2.0}
    assert [s for s, _ in scalars["checkpoint/save_seconds"]][-1] == total
    assert scalars["eval/test_accuracy"] == [(total, pytest.approx(rec["metrics"]["test_accuracy"]))]

    # The log: the orchestrator's own lines, progress lines, and none of Ray's noise.
    for noise in RAY_NOISE:
        assert not re.search(noise, output), f"Ray noise {noise!r} in the output:\n{output[-3000:]}"
    progress = [(int(a), int(b)) for a, b in PROGRESS.findall(output)]
    assert len(progress) >= 3 and progress[-1] == (total, total), output[-3000:]
    for line in ("2 workers started, training from step 0", "checkpoint committed: step 100,",
                 "][orchestrator][WARNING] - fault: worker rank 1 at step",
                 f"restart 1 after a worker failure: 2 workers resume from the checkpoint at step "
                 f"{restart_step}", f"resumed from {tmp_path / 'ckpt'}", "succeeded in"):
        assert line in output, f"{line!r} missing:\n{output[-3000:]}"
    # Every line is the orchestrator's, but Ray's own error messages (the raylet's word on the
    # killed worker: it still prints those, whatever log_to_driver says).
    others = [ln for ln in output.splitlines() if not re.match(r"\[20.*\]\[orchestrator\]\[", ln)]
    assert all("(raylet)" in ln for ln in others), others


ACTOR_ON_THE_HEAD = """
import os, ray
ray.init(address=os.environ["HEAD"], log_to_driver=False)
@ray.remote(num_cpus=0)
class A:
    def f(self):
        return 7
a = A.remote()  # held: an actor whose last handle goes before it starts is cancelled
print(ray.get(a.f.remote(), timeout=60))
"""


def test_ray_verbose_brings_rays_lines_back_the_bar_draws_and_ctrl_c_at_the_end_is_quiet(
        tmp_path, ray_head):
    """Also the regression test of a Ctrl-C that lands while the command shuts its embedded
    Ray down: it used to raise inside ray.shutdown() (a traceback, the cluster half stopped),
    and the handler's Ray call then joined the cluster `ray start` had recorded on the machine
    (the session's head): every later run on that head failed."""
    from orchestrator.driver.processes import descendants, running

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        cli_command(run_dir, f"storage.uri={tmp_path / 'ckpt'}",
                    f"cluster.dashboard_port={free_port()}", "trainer.max_steps=30",
                    "log.ray_verbose=true", "log.progress=bar", "log.tensorboard=false",
                    "log.metrics=false"),
        cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _started.append(proc)
    # The embedded cluster's processes, seen while it trains and as the run ends (a loaded
    # machine may run the command past its shutdown before a poll sees "succeeded").
    wait_for(lambda r: r.get("steps", 0) >= 1, run_dir, timeout=480, every_s=0.05)
    left_behind = set(descendants(proc.pid))
    # run.json says succeeded just before the command stops Ray: Ctrl-C then. The window is
    # the shutdown's: looked for every 10 ms (at 0.2 s, 1 of 4 runs on a loaded hour
    # signalled a command that had already exited 0).
    wait_for(lambda r: r.get("status") == "succeeded", run_dir, timeout=480, every_s=0.01)
    left_behind |= set(descendants(proc.pid))
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    output = stdout + stderr
    assert proc.returncode == 130, output[-4000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-4000:]
    assert "interrupted while shutting down, after the run succeeded" in output
    assert read_record(run_dir)["status"] == "succeeded"
    assert left_behind and not [p for p in left_behind if running(p)]  # the cluster is gone
    # A new driver on the machine's recorded cluster still runs an actor there.
    check = subprocess.run([sys.executable, "-c", ACTOR_ON_THE_HEAD], cwd=REPO,
                           env=cli_env({"HEAD": ray_head.address,
                                        **({"RAY_AUTH_MODE": "token"} if token_headers() else {})}),
                           capture_output=True, text=True, timeout=120)
    assert check.stdout.strip().endswith("7"), check.stderr[-3000:]

    assert re.search(r"\(RayTrainWorker pid=\d+", output), output[-3000:]
    assert re.search(r"\(TrainController pid=\d+", output)
    # (Ray says it only where the command starts with no RAY_AUTH_MODE: an earlier test's
    # in-process join may have set it in this process, which the command inherits)
    assert "Token authentication is enabled" in output or not embedded_token_auth() or \
        os.environ.get("RAY_AUTH_MODE")
    # (universal newlines turn the bar's \r into \n here)
    assert "\x1b[Kstep 30/30 [" + "=" * 20 + "] 100% | ETA 0:00 |" in stderr
    assert "\x1b[Kwaiting for the workers to start" in stderr
    assert not (run_dir / "tensorboard").exists() and "metrics: http" not in output
    assert not PROGRESS.search(output)  # the bar instead of lines


def processes_in(folder: Path) -> list[str]:
    """The command lines of the processes working in ``folder`` (Ray's start in it, here)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd") == str(folder):
                found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return found


CTRL_C_IN_AN_IMPORT = r"""
import os, signal, sys, threading
from orchestrator.driver.interrupts import interrupt_after

pressed = threading.Event()
def press():  # Ctrl-C twice while the trial imports torch: the first waits, the second does not
    pressed.wait()
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=press, daemon=True).start()
try:
    with interrupt_after():
        pressed.set()
        import torch  # noqa: F401  (pybind11 calls back into Python as it loads)
        print("imported", hasattr(torch, "nn"), flush=True)
except KeyboardInterrupt:
    print("raised after the block", flush=True)
try:
    with interrupt_after():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a moment for the handler to run
        print("not reached", flush=True)
except KeyboardInterrupt:
    print("raised at the second", flush=True)
"""


SIGTERM_IN_AN_IMPORT = r"""
import os, signal, threading
from orchestrator.driver.interrupts import interrupt_after, sigterm_as_ctrl_c

sigterm_as_ctrl_c()
importing = threading.Event()
def stop():  # a SIGTERM while the trial imports torch, in a command whose Ctrl-C is ignored
    importing.wait()
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=stop, daemon=True).start()
try:
    with interrupt_after():
        importing.set()
        import torch  # noqa: F401
        print("imported", hasattr(torch, "nn"), flush=True)
except KeyboardInterrupt:
    print("raised after the block", flush=True)
"""


def test_ctrl_c_during_a_frameworks_import_is_raised_once_it_is_imported():
    """interrupts.interrupt_after, around the trial of the user's parts: a Ctrl-C that came
    while torch was importing aborted the command (SIGABRT from pybind11, seen in CI) instead
    of exit 130; now it is raised once the block ends, and a second Ctrl-C at once. So is a
    SIGTERM where Ctrl-C is ignored (a command in the background)."""
    done = subprocess.run([sys.executable, "-c", CTRL_C_IN_AN_IMPORT], cwd=REPO,
                          env=cli_env(), capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == ["imported True", "raised after the block",
                                            "raised at the second"], done.stdout
    # A background command (Ctrl-C ignored) stopped by SIGTERM during the import: held too.
    done = subprocess.run([sys.executable, "-c", SIGTERM_IN_AN_IMPORT], cwd=REPO,
                          env=cli_env(), capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["imported True", "raised after the block"], (
        done.stdout, done.stderr[-3000:])


def test_ctrl_c_while_ray_starts_is_one_line_and_leaves_no_process(tmp_path):
    """Ctrl-C as the embedded raylet starts its agents: the raylet stopped mid-start left its
    dashboard and runtime-env agents running, orphaned, after the command ended (and a Ctrl-C
    in the background start's wait was a Hydra traceback, exit 1)."""
    # As from a terminal: a test run in the background (CI's) has SIGINT ignored, and a
    # Python started so keeps ignoring it.
    proc = subprocess.Popen(cli_command(tmp_path / "run", "trainer.epochs=1"), cwd=tmp_path,
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 120
        while not any("raylet" in c for c in processes_in(tmp_path)) and time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in out, out[-3000:]
    deadline = time.time() + 10  # what is stopped may take a moment to go
    while (left := [c for c in processes_in(tmp_path) if "ray" in c]) and time.time() < deadline:
        time.sleep(0.2)
    assert not left, left
