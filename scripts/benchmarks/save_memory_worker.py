"""One rank of fsdp_checkpoint's memory measurement, run by torchrun (2 processes, gloo, no
Ray): the LM example's ~101M-parameter model sharded with the trainer's own FSDP code (and
its allocator setting for FSDP on CPU, trainer.release_host_memory), one AdamW step (its
moments exist), then the trainer's own save (TrainingState.write: DCP's async_save, a copy of
the shards in memory written to local disk in the background) and the orchestrator's own
upload of this rank's part to S3, with the resident set sampled every 10 ms. Prints this
rank's JSON line: RSS before, peak while saving, shard.

    torchrun --nproc-per-node=2 scripts/benchmarks/save_memory_worker.py ENDPOINT BUCKET/PREFIX
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "examples" / "char_lm")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from charlm.model import TinyGPT  # noqa: E402

from orchestrator.checkpoint.committer import Committer  # noqa: E402
from orchestrator.checkpoint.store import CheckpointStore  # noqa: E402
from orchestrator.storage.location import Credentials, StorageSpec  # noqa: E402
from trainers.pytorch.host_memory import release_freed_memory  # noqa: E402
from trainers.pytorch.parallel import materialize, shard  # noqa: E402
from trainers.pytorch.precision import Precision  # noqa: E402
from trainers.pytorch.state import TrainingState  # noqa: E402


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    endpoint, uri = sys.argv[1], sys.argv[2]
    release_freed_memory()  # as the trainer does for FSDP on CPU (release_host_memory: null)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        module = TinyGPT(dim=1024, heads=16, layers=8, seq_len=64)
    shard(module, {}, "32")
    materialize(module, torch.device("cpu"), 1 + rank)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (1, 64))
    torch.nn.functional.cross_entropy(module(ids).reshape(-1, 256), ids.reshape(-1)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = TrainingState(module, optimizer, None, Precision("32", torch.device("cpu")), rank, True)
    spec = StorageSpec(uri, endpoint, "us-east-1", Credentials(os.environ["AWS_ACCESS_KEY_ID"],
                                                               os.environ["AWS_SECRET_ACCESS_KEY"]))
    committer = Committer(CheckpointStore(spec), rank, world, "bench", asynchronous=True)
    dist.barrier()
    before, peak, done = rss_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mib())
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "step_1"
        folder.mkdir()
        started = time.perf_counter()
        pending = state.write(folder, background=True)  # a periodic save: the shards copied
        written = time.perf_counter() - started
        committer.snapshot(1, folder, {"step": 1}, written, pending)
        committer.close()  # this rank's part stored (rank 0: the checkpoint committed)
        saved = time.perf_counter() - started
    done.set()
    sampler.join()
    files = committer.store.parts(1, "bench")[rank]["files"]
    shard_bytes = sum(f["bytes"] for name, f in files.items() if name.endswith(".distcp"))
    print(json.dumps({"rank": rank, "rss_before_mib": round(before, 1),
                      "peak_while_saving_mib": round(peak[0], 1),
                      "added_mib": round(peak[0] - before, 1),
                      "shard_mib": round(shard_bytes / 2**20, 1), "blocked_s": round(written, 3),
                      "write_and_upload_s": round(saved, 3)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
