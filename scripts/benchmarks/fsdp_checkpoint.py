"""Sharded checkpoints to object storage: FSDP on 2 workers, the ~101M-parameter transformer
of fsdp_memory (a checkpoint of ~1.2 GiB: parameters and AdamW's two moments, half on each
rank), to SeaweedFS on loopback (started here).

- Step blocked per checkpoint, async upload against sync (checkpoint.async_upload=false): from
  the run record, save_s (the rank's write(dir): DCP's async_save copying its shards in
  memory) for async; save_s + write_s (the files written from that copy) + upload_s for sync,
  where the step waits for all of it; medians over each run's periodic checkpoints (the first
  3: the last one, at the run's end, is written directly in both, nothing left to overlap).
- Stored bytes per second: the sync run's upload_s of a checkpoint (nothing else running, as
  for the raw uploads) against plain pyarrow uploads of the same files (one thread per rank's
  files, as the ranks upload), in the same run. The async run's uploads share the 2 cores with
  2 training workers; their rate is reported beside it.
- Memory added on a rank while saving, against the size of its shard: the same model and
  optimizer state, sharded by the trainer's own code over 2 torchrun processes (gloo, no Ray:
  no other work in the process), saved by the trainer's own TrainingState.write and uploaded
  by the orchestrator's own Committer, the resident set sampled every 10 ms
  (scripts/benchmarks/save_memory_worker.py). VmHWM of a whole run cannot single out the save.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from scripts.benchmarks.common import (
    PYTHON,
    REPO,
    Goal,
    figure,
    progress,
    ratio,
    read_json,
    run_timed,
)
from scripts.benchmarks.fsdp_memory import BIG, EXAMPLE, example_cmd
from scripts.benchmarks.memory import run_watched

GOAL_BLOCKED = Goal("<=", 0.1)
GOAL_UPLOAD = Goal(">=", 0.8)
GOAL_MEMORY = Goal("<=", 1.2)
MIB = 1 << 20


def overrides(server, steps: int, every: int | None, asynchronous: bool) -> list[str]:
    return ["+experiment=char_lm", "trainer=fsdp", "trainer.fsdp.meta_init=true", *BIG,
            "cluster.workers=2", "trainer.batch_size=8", f"trainer.max_steps={steps}",
            "trainer.epochs=100", f"checkpoint.every_steps={every or 100000}", "checkpoint.keep=0",
            f"checkpoint.async_upload={str(asynchronous).lower()}", "storage=s3",
            f"storage.endpoint={server.endpoint}", "log.tensorboard=false", "log.metrics=false"]


def one_run(work: Path, server, name: str, extra: list[str]) -> dict:
    run_dir = work / name
    cmd = [c for c in example_cmd(run_dir, *extra) if not c.startswith("storage.uri=")]
    cmd.append(f"storage.uri=s3://bench/{name}")
    env = {"PYTHONPATH": str(EXAMPLE), "AWS_ACCESS_KEY_ID": server.access_key,
           "AWS_SECRET_ACCESS_KEY": server.secret_key}
    timed, peaks = run_watched(cmd, work / f"{name}.log", env=env, timeout=1800)
    rec = read_json(run_dir / "run.json")
    progress(f"fsdp_checkpoint {name}: {timed.wall_s} s, workers {peaks['train_workers_mib']} MiB")
    return {"wall_s": timed.wall_s, "workers_mib": peaks["train_workers_mib"],
            "checkpoints": rec.get("checkpoints", []), "uri": rec.get("checkpoint_uri"),
            "status": rec.get("status")}


def raw_upload(server, uri: str, step: int, scratch: Path) -> dict:
    """The checkpoint's files downloaded, then uploaded again with plain pyarrow: one thread
    per rank's files, as the ranks upload theirs."""
    from orchestrator.checkpoint.store import CheckpointStore
    from orchestrator.storage.location import Credentials, StorageSpec

    spec = StorageSpec(uri, server.endpoint, "us-east-1",
                       Credentials(server.access_key, server.secret_key))
    store = CheckpointStore(spec)
    ref = store.ref(step)
    files = store.read_manifest(ref)["files"]
    folder = store.fetch(ref, scratch)
    fs = server.filesystem()
    by_rank: dict[int, list[str]] = {}
    for name, entry in files.items():
        by_rank.setdefault(entry["rank"], []).append(name)

    def upload(names: list[str]) -> None:
        for name in names:
            with open(folder / name, "rb") as src, fs.open_output_stream(f"bench/raw/{name}") as dst:
                while block := src.read(8 * MIB):
                    dst.write(block)

    threads = [threading.Thread(target=upload, args=(names,)) for names in by_rank.values()]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    shards = {entry["rank"]: entry["bytes"] for name, entry in files.items()
              if name.endswith(".distcp")}
    return {"bytes": sum(e["bytes"] for e in files.values()), "seconds": round(seconds, 3),
            "shard_bytes_by_rank": shards}


def run(args: argparse.Namespace, work: Path) -> dict:
    from scripts.s3_server import SeaweedS3

    steps, every = args.fsdp_steps * 4, args.fsdp_steps
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp:
        # Two runs of two ~1.1 GB checkpoints each: 16 volumes of 256 MB ran out (measured).
        server = SeaweedS3(Path(tmp) / "weed", volumes=64).start()
        try:
            server.filesystem().create_dir("bench")
            runs = {"async": one_run(work, server, "async", overrides(server, steps, every, True)),
                    "sync": one_run(work, server, "sync", overrides(server, steps, every, False))}
            last = runs["async"]["checkpoints"][-1]["step"]
            raw = raw_upload(server, runs["async"]["uri"], last, Path(tmp) / "raw")
            memory = save_memory(server, work)
        finally:
            server.stop(kill=True)
    return summarize(runs, raw, memory)


def save_memory(server, work: Path) -> list[dict]:
    timed = run_timed([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                       str(REPO / "scripts" / "benchmarks" / "save_memory_worker.py"),
                       server.endpoint, "s3://bench/save-memory"], work / "save-memory.log",
                      env={"AWS_ACCESS_KEY_ID": server.access_key,
                           "AWS_SECRET_ACCESS_KEY": server.secret_key}, timeout=1200)
    ranks = [json.loads(line) for line in timed.output.splitlines() if line.startswith('{"rank"')]
    progress(f"fsdp_checkpoint save memory: {ranks}")
    return sorted(ranks, key=lambda r: r["rank"])


def summarize(runs: dict[str, dict], raw: dict, memory: list[dict]) -> dict:
    def med(values: list[float]) -> float | None:
        return round(statistics.median(values), 4) if values else None

    def periodic(checkpoints: list[dict]) -> list[dict]:
        return [c for c in checkpoints if c["step"] < max(c["step"] for c in checkpoints)]

    a, s = runs["async"]["checkpoints"], runs["sync"]["checkpoints"]
    blocked_async = med([c["save_s"] for c in periodic(a)])
    blocked_sync = med([c["save_s"] + c.get("write_s", 0.0) + c["upload_s"] for c in periodic(s)])
    def rate(checkpoints: list[dict]) -> float | None:
        return med([c["bytes"] / c["upload_s"] / MIB for c in checkpoints if c["upload_s"] > 0])

    ours, beside_training = rate(s), rate(a)
    theirs = raw["bytes"] / raw["seconds"] / MIB if raw["seconds"] else None
    added_vs_shard = max((m["added_mib"] / m["shard_mib"] for m in memory if m["shard_mib"]),
                         default=None)
    return {
        "job": {"model": "TinyGPT dim 1024, 8 blocks (~101M parameters), FSDP on 2 workers",
                "checkpoint_mib": round(raw["bytes"] / MIB, 1),
                "shards_mib": {r: round(b / MIB, 1) for r, b in raw["shard_bytes_by_rank"].items()}},
        "blocked_s": {"async": blocked_async, "sync": blocked_sync},
        "upload_mib_per_s": {"orchestrator": ours, "raw_pyarrow": round(theirs, 1) if theirs else None,
                             "orchestrator_beside_training": beside_training},
        "memory_while_saving": memory,
        "figures": {
            "blocked_async_vs_sync": figure(ratio(blocked_async, blocked_sync), GOAL_BLOCKED),
            "upload_vs_raw_pyarrow": figure(ratio(ours, theirs), GOAL_UPLOAD),
            "memory_added_vs_shard": figure(round(added_vs_shard, 3) if added_vs_shard else None,
                                            GOAL_MEMORY),
        },
        "raw": raw,
        "runs": runs,
    }
