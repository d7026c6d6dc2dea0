"""Helpers more than one test module uses (conftest.py holds the fixtures and the command
line as a subprocess): a refused command's one line, a sweep as a command, a run's model and
checkpoints read back, manifests planted as an attacker would."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from orchestrator.checkpoint.store import MANIFEST, CheckpointStore, step_dir
from orchestrator.storage.location import StorageSpec, join
from tests.conftest import REPO, cli_env, forked


def assert_input_error(result, key: str, storage=None):
    lines = [ln for ln in result.stderr.strip().splitlines() if ln.strip()]
    assert result.returncode == 2, result.output[-3000:]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and key in lines[0], lines[0]
    assert "Started a local Ray" not in result.output and "RayTrainWorker" not in result.output
    if storage is not None:
        assert not storage.exists() or not any(storage.rglob("*")), "storage was written"


def sweep(sweep_dir: Path, *overrides: str, address: str, timeout: float = 900,
          flags: tuple[str, ...] = (), cwd: Path = REPO):
    cmd = [sys.executable, "-m", "orchestrator", "--multirun", *flags,
           f"hydra.sweep.dir={sweep_dir}", f"cluster.address={address}",
           f"storage.uri={sweep_dir.parent / 'ckpt'}", *overrides]
    proc = subprocess.run(forked(cmd), cwd=cwd, env=cli_env(), capture_output=True, text=True,
                          timeout=timeout)
    return proc


def sweep_record(sweep_dir: Path) -> dict:
    return json.loads((sweep_dir / "sweep.json").read_text())


def stored_path(step_folder, name: str, fs=None) -> str:
    """Where a committed checkpoint's file ``name`` lies in its step folder (under its writer's
    attempt, as its manifest says): a local path, or a path in the pyarrow filesystem ``fs``."""
    if fs is None:
        manifest = json.loads((Path(step_folder) / MANIFEST).read_text())
        return str(Path(step_folder) / manifest["files"][name].get("key", name))
    with fs.open_input_stream(join(str(step_folder), MANIFEST)) as f:
        manifest = json.loads(f.read())
    return join(str(step_folder), manifest["files"][name].get("key", name))


def model_at(storage, run_name, step=None) -> dict:
    """The PyTorch trainer's model.pt in a run's checkpoint (its newest, or ``step``'s)."""
    import io

    import torch

    store = CheckpointStore(StorageSpec(str(storage / run_name)))
    ref = store.latest() if step is None else store.ref(step)
    return torch.load(io.BytesIO(store.load(ref)[0]["model.pt"]), weights_only=True)


def load_newest_intact(store: CheckpointStore, tmp_path: Path, skipped=None):
    found = store.newest_intact(tmp_path / "cache", skipped)
    if found is None:
        return None
    ref, folder = found
    manifest = json.loads((folder / MANIFEST).read_text())
    return ref, {name: (folder / name).read_bytes() for name in manifest["files"]}, manifest["meta"]


def rank_folder(tmp_path: Path, rank: int, files: dict[str, bytes]) -> Path:
    folder = tmp_path / f"snapshot-rank{rank}"
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def plant_manifest(store: CheckpointStore, step: int, name: str, data: bytes = b"owned") -> None:
    """A committed checkpoint at ``step`` whose manifest also lists ``name``, its size and hash
    right (what anyone able to write the bucket or folder could publish). In an object store
    the object is put where a download would read it, when the store takes such a key."""
    store.save(step, {"a": b"newer"})
    ref = store.ref(step)
    with store.fs.open_input_stream(join(ref.path, MANIFEST)) as f:
        manifest = json.loads(f.read())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                               "rank": 0}
    with store.fs.open_output_stream(join(ref.path, MANIFEST)) as f:
        f.write(json.dumps(manifest).encode())
    if store.is_local:
        return  # a local store's files are only ever linked from its own folder
    try:
        with store.fs.open_output_stream(join(ref.path, name)) as f:
            f.write(data)
    except (OSError, ValueError):
        pass  # a store that refuses the key: the manifest alone is the attack


def bad_names(tmp_path: Path) -> dict[str, str]:
    """Names that would land in tmp_path/outside: absolute, and '..' from a step folder (the
    local store's, or the download cache's, both two levels below tmp_path)."""
    return {"absolute": str(tmp_path / "outside" / "evil.pth"),
            "dotdot": "../../outside/evil.pth"}


def assert_planted_one_refused(store: CheckpointStore, tmp_path: Path, name: str) -> None:
    skipped: list[str] = []
    ref, files, _ = load_newest_intact(store, tmp_path, skipped)
    assert ref.step == 10 and files == {"a": b"good"}
    assert not (tmp_path / "outside").exists()
    assert len(skipped) == 1 and step_dir(20) in skipped[0] and repr(name) in skipped[0], skipped


def digits_parquet(folder: Path) -> Path:
    """The bundled digits as parquet: 1,797 rows in 6 files of 3 row groups; column 'id'
    first (a feature tests/user_project/mypkg/ids.py's LoggingTabular logs)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from orchestrator.data.datasets import digits

    x, y = digits()
    folder.mkdir()
    for f, rows in enumerate(np.array_split(np.arange(len(y)), 6)):
        table = pa.table({"id": rows.astype(np.float32),
                          **{f"p{i}": x[rows, i].astype(np.float32) for i in range(64)},
                          "label": y[rows]})
        pq.write_table(table, folder / f"digits-{f}.parquet", row_group_size=100)
    return folder


def rows_per_step(log_dir: Path, record: dict) -> dict[int, list[float]]:
    """Each step's rows (their logged id feature) over all ranks, from LoggingTabular's lines:
    one forward a step; a rank's lines come in attempts (a pid and a world size each), each
    the next worker group of run.json's world_sizes of that size (a group that died before
    its first step logged nothing). A group replaces what earlier ones logged from its start
    step on (steps lost to a failure are trained again)."""
    groups = record["world_sizes"]
    attempts: dict[tuple[int, int], list] = {}  # (group, rank) -> the ids of each step
    for path in sorted(log_dir.glob("rank*.jsonl")):
        rank, g, last = int(path.stem[4:]), -1, None
        for line in path.read_text().splitlines():
            try:
                pid, size, ids = json.loads(line)
            except ValueError:  # the last line of a worker killed mid-write
                continue
            if pid != last:  # this rank's next attempt: the next group of its size
                g = next(i for i in range(g + 1, len(groups)) if groups[i]["size"] == size)
                last = pid
            attempts.setdefault((g, rank), []).append(ids)
    seen: dict[int, dict[int, list[float]]] = {}
    for g, group in enumerate(groups):
        for step in [s for s in seen if s >= group["step"]]:
            del seen[step]
        for (at, rank), lines in attempts.items():
            if at == g:
                for i, ids in enumerate(lines):
                    seen.setdefault(group["step"] + i, {})[rank] = ids
    return {step: sorted(x for ids in ranks.values() for x in ids) for step, ranks in seen.items()}


def raylet_of(address: str) -> int | None:
    """The pid of the raylet of the Ray whose GCS is at ``address``: the processes of that
    node's workers carry it (RAY_RAYLET_PID), which tells them from another Ray's on the
    machine (the other test process's, another user's)."""
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        gcs = [a for a in args[1:] if a.startswith(b"--gcs-address=")]
        # Ray passes the GCS under the machine's own address even for a head started on
        # 127.0.0.1: the port, unique on this machine, tells it is this one.
        if args and args[0].endswith(b"/raylet") and gcs and \
                gcs[0].rpartition(b":")[2] == address.rpartition(":")[2].encode():
            return int(entry.name)
    return None


def of_raylet(environ: bytes, raylet: int | None) -> bool:
    """A process's environment (/proc/<pid>/environ) says it is a worker of this raylet."""
    return f"RAY_RAYLET_PID={raylet}".encode() in environ.split(b"\0")


def ray_version() -> tuple[int, int]:
    """The installed Ray's (major, minor): `make smoke` runs tests on the range's oldest."""
    from orchestrator.ray_internals.versions import installed, release

    return release(installed("ray"))


def embedded_token_auth() -> bool:
    """A Ray a command starts itself turns token auth on where a token exists: Ray 2.60 does,
    without RAY_AUTH_MODE; 2.58 and 2.59 only with it."""
    return bool(token_headers()) and (ray_version() >= (2, 60) or
                                      os.environ.get("RAY_AUTH_MODE") == "token")


def token_headers() -> dict[str, str]:
    """What the dashboard's HTTP API asks of a client where Ray's token auth is on."""
    token = os.environ.get("RAY_AUTH_TOKEN")
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if token is None and path.exists():
        token = path.read_text().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def train_page(dashboard: str) -> str:
    """The dashboard's Train page data, through its HTTP API (with the token where asked)."""
    request = urllib.request.Request(f"{dashboard}/api/train/v2/runs/v1", headers=token_headers())
    return urllib.request.urlopen(request, timeout=30).read().decode()


def train_page_names(dashboard: str) -> set[str]:
    """The names of the runs on the dashboard's Train page (none where no run of the cluster
    was tracked: the page then answers 500, no state actor)."""
    try:
        body = train_page(dashboard)
    except urllib.error.HTTPError as exc:
        assert exc.code == 500, exc
        return set()
    return {r["name"] for r in json.loads(body)["train_runs"]}


def train_page_run(dashboard: str, name: str, timeout: float = 60) -> tuple[dict, str]:
    """The run of that name on the dashboard's Train page once it shows an end (Ray Train
    reports it as the controller ends), and the whole page's text."""
    deadline = time.monotonic() + timeout
    while True:
        body = train_page(dashboard)
        runs = [r for r in json.loads(body)["train_runs"] if r["name"] == name]
        if runs and runs[0]["status"] in ("FINISHED", "ERRORED", "ABORTED") or \
                time.monotonic() > deadline:
            assert len(runs) == 1, [r["name"] for r in json.loads(body)["train_runs"]]
            return runs[0], body
        time.sleep(0.5)
