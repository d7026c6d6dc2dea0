"""Checkpoint cost on a real S3 server (SeaweedFS on loopback), measured side by side.

    python scripts/bench_checkpoint.py [--mib 128] [--repeats 3]

Prints JSON: checkpoint bytes; snapshot (save) seconds; upload seconds and MiB/s of the
orchestrator's commit path against a raw pyarrow upload of the same bytes to the same
server, interleaved in the same run; and the time a training step is blocked per checkpoint,
async against sync.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.checkpoint.committer import Committer  # noqa: E402
from orchestrator.checkpoint.store import CheckpointStore  # noqa: E402
from orchestrator.storage.location import Credentials, StorageSpec  # noqa: E402
from scripts.s3_server import SeaweedS3  # noqa: E402

MIB = 1 << 20


def raw_upload_s(server: SeaweedS3, key: str, data: bytes) -> float:
    fs = server.filesystem()
    started = time.perf_counter()
    with fs.open_output_stream(key) as f:
        f.write(data)
    return time.perf_counter() - started


def snapshot(committer: Committer, staging: Path, step: int, data: bytes) -> float:
    """Write the checkpoint's file (the rank's write(dir)) and hand it over: the time the
    step is blocked (the file write is the same in both modes)."""
    started = time.perf_counter()
    folder = staging / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "model.bin").write_bytes(data)
    committer.snapshot(step, folder, {"step": step})
    return time.perf_counter() - started


def blocked_per_checkpoint(store: CheckpointStore, asynchronous: bool, data: bytes,
                           steps: int, every: int, step_s: float, staging: Path) -> list[float]:
    """A training loop of `steps` steps of `step_s` each, checkpointing every `every` steps."""
    committer = Committer(store, asynchronous=asynchronous)
    blocked = []
    for step in range(steps):
        time.sleep(step_s)  # the step's compute
        if (step + 1) % every == 0:
            blocked.append(snapshot(committer, staging, step + 1, data))
    committer.close()
    return blocked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=128, help="checkpoint size in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-s", type=float, default=0.2,
                        help="simulated step time (10 steps between checkpoints)")
    args = parser.parse_args()

    data = secrets.token_bytes(args.mib * MIB)  # incompressible, like trained weights
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp:
        server = SeaweedS3(Path(tmp)).start()
        try:
            server.filesystem().create_dir("bench")
            spec = StorageSpec("s3://bench/runs", server.endpoint, "us-east-1",
                               Credentials(server.access_key, server.secret_key))
            raw, ours, save = [], [], []
            for i in range(args.repeats):  # interleaved: the machine's noise hits both alike
                raw.append(raw_upload_s(server, f"bench/raw/{i}.bin", data))
                committer = Committer(CheckpointStore(spec.child(f"sync-{i}")), asynchronous=False)
                done = []
                committer.on_commit = done.append
                snapshot(committer, Path(tmp) / f"staging-{i}", 1, data)
                committer.close()
                ours.append(done[0].upload_s)
                save.append(done[0].save_s)
            steps, every = 40, 10
            sync_blocked = blocked_per_checkpoint(CheckpointStore(spec.child("loop-sync")), False,
                                                  data, steps, every, args.step_s,
                                                  Path(tmp) / "loop-sync")
            async_blocked = blocked_per_checkpoint(CheckpointStore(spec.child("loop-async")), True,
                                                   data, steps, every, args.step_s,
                                                   Path(tmp) / "loop-async")
        finally:
            server.stop(kill=True)

    mib = len(data) / MIB
    raw_mibs = mib / statistics.median(raw)
    our_mibs = mib / statistics.median(ours)
    result = {
        "checkpoint_bytes": len(data),
        "save_s": round(statistics.median(save), 4),
        "upload_s": round(statistics.median(ours), 3),
        "upload_mib_per_s": round(our_mibs, 1),
        "raw_pyarrow_upload_s": round(statistics.median(raw), 3),
        "raw_pyarrow_mib_per_s": round(raw_mibs, 1),
        "upload_vs_raw": round(our_mibs / raw_mibs, 3),
        "goal_upload_vs_raw": ">= 0.8",
        "step_blocked_s_sync": round(statistics.mean(sync_blocked), 4),
        "step_blocked_s_async": round(statistics.mean(async_blocked), 4),
        "async_vs_sync_blocked": round(statistics.mean(async_blocked) / statistics.mean(sync_blocked), 4),
        "goal_async_vs_sync": "<= 0.1",
        "repeats": args.repeats,
        "checkpoints_per_loop": len(sync_blocked),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
