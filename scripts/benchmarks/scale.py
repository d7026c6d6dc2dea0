"""The control plane at 16-1,024 ranks, simulated against the real store (issue 65).

Each simulated rank is a thread running the real checkpoint code (orchestrator/checkpoint/:
its Committer uploads its file and writes its part record; rank 0's waits for every part,
then commits the manifest) against a real SeaweedFS S3 server started here. Figures for each
N: the time from the last rank's part stored to the commit, and the requests sent to the
store for one checkpoint (every call into the S3 filesystem, counted), in all and per rank;
rank 0's own requests, and the records it read. And run.json's size after 1,000 worker
groups that each failed (the run record, as the recorder keeps it).

Also, on a real (embedded) Ray: the run recorder's CPU per reported step (rank 0's reports,
never one per rank), and the preemption agreement at each N (PER_NODE ranks a node): rank 0's
answer and each other node's call for it into the run's controller class, and one node's
ranks reading it from the node's folder; beside it Ray's public calls (two barriers of one
call per rank, the path where the hooks are off). The storage probe: its one marker read by
10 and 100 simultaneous readers. `--scale-parts agreement` runs one part. See
docs/benchmarks.md ("Scale").
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from orchestrator.config.schema import FailureConfig
from orchestrator.worker.preemption_checks import check_period
from scripts.benchmarks.common import Goal, figure, progress
from scripts.benchmarks.proctree import cpu_s

SIZES = (16, 64, 256, 1024)
THREADS = 32  # the simulated ranks' uploads in flight at once
CHECK_EVERY_S = FailureConfig().preemption_check_s  # the default


class CountedFS:
    """An S3 filesystem that counts each call made to it (each is one or more requests)."""

    def __init__(self, fs, counts: dict, lock: threading.Lock, who: str):
        self._fs, self._counts, self._lock, self._who = fs, counts, lock, who

    def __getattr__(self, name):
        attr = getattr(self._fs, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            with self._lock:
                key = f"{self._who}:{name}"
                self._counts[key] = self._counts.get(key, 0) + 1
            return attr(*args, **kwargs)

        return counted


def one_checkpoint(server, world: int, work: Path) -> dict:
    from orchestrator.checkpoint.committer import Committer
    from orchestrator.checkpoint.retry import Backoff
    from orchestrator.checkpoint.store import PARTS, CheckpointStore
    from orchestrator.storage.location import Credentials, StorageSpec

    spec = StorageSpec(f"s3://scale-bench/n{world}-{time.time_ns()}", server.endpoint, "us-east-1",
                       Credentials(server.access_key, server.secret_key), create_bucket=True)
    counts: dict[str, int] = {}
    lock = threading.Lock()
    reads: list[str] = []

    def store_for(rank: int) -> CheckpointStore:
        store = CheckpointStore(spec)
        store.fs = CountedFS(store.fs, counts, lock, "rank0" if rank == 0 else "others")
        if rank == 0:
            real = store._read_record
            store._read_record = lambda step, name, where: (
                reads.append(name) if name.startswith(PARTS) else None,
                real(step, name, where))[1]
        return store

    folders = []
    for rank in range(world):
        folder = work / f"n{world}" / f"rank{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"shard_{rank}.bin").write_bytes(rank.to_bytes(4, "little") * 256)  # 1 KiB
        folders.append(folder)
    committed = {}
    backoff = Backoff(first_s=0.05, max_s=1.0, deadline_s=600)
    rank0 = Committer(store_for(0), 0, world, "bench", asynchronous=False, backoff=backoff,
                      on_commit=lambda c: committed.setdefault("at", time.monotonic()))
    zero = threading.Thread(target=rank0.snapshot, args=(100, folders[0], {}))
    started = time.monotonic()
    zero.start()
    last_part = [0.0]

    def part(rank: int) -> None:
        Committer(store_for(rank), rank, world, "bench", asynchronous=False,
                  backoff=backoff).snapshot(100, folders[rank], {})
        with lock:
            last_part[0] = max(last_part[0], time.monotonic())

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(part, range(1, world)))
    zero.join(timeout=900)
    if "at" not in committed:
        raise RuntimeError(f"no commit at N={world}")
    total = sum(counts.values())
    rank0_calls = sum(v for k, v in counts.items() if k.startswith("rank0:"))
    return {"ranks": world, "parts_stored_s": round(last_part[0] - started, 2),
            "commit_after_last_part_s": round(committed["at"] - last_part[0], 3),
            "store_calls": total, "store_calls_per_rank": round(total / world, 2),
            "rank0_calls": rank0_calls, "rank0_part_records_read": len(reads),
            "calls_by_kind": dict(sorted(counts.items()))}


def run_record_size(attempts: int = 1000) -> dict:
    """run.json after ``attempts`` worker groups, each failed by a worker's error."""
    from orchestrator.driver.failure_policy import WorkerError
    from orchestrator.driver.record import RunRecord

    record = RunRecord("scale", "ddp", {"trainer": {"name": "ddp"}}, "s3://bucket/scale",
                       started_at=time.time())
    for attempt in range(attempts):
        step = attempt * 10
        record.group_started(4, step, time.time(), 100_000)
        for rank in range(4):
            record.worker_started(rank, 1000 + attempt * 4 + rank, f"node{attempt % 7}")
        record.progress(step + 5, 320, {"loss": 0.5}, time.time())
        record.checkpoint(step + 5, f"s3://bucket/scale/step_{step + 5:09d}", 10_000, 0.1, 0.2)
        record.worker_error(WorkerError(rank=attempt % 4, step=step + 7, kind="RuntimeError",
                                        message=f"connection lost #{attempt}",
                                        traceback="Traceback ...\nRuntimeError: lost\n" * 20))
        record.group_failed()
    record.warning("a warning")
    text = json.dumps(record.to_dict())
    return {"attempts": attempts, "bytes": len(text.encode()),
            "world_sizes": len(record.to_dict().get("world_sizes", [])),
            "failures": len(record.to_dict().get("failures", []))}


def probe_time(server, nodes: int) -> dict:
    """The shared-storage probe (orchestrator/storage/probe.py) as ``nodes`` nodes answer it:
    the driver's one write, then each node's read of it (its Ray task's body, reads_back), all
    at once as the tasks run on their nodes, then the probe's removal."""
    import secrets

    from orchestrator.storage.location import Credentials, StorageSpec
    from orchestrator.storage.probe import reads_back

    spec = StorageSpec("s3://scale-bench/probe", server.endpoint, "us-east-1",
                       Credentials(server.access_key, server.secret_key))
    fs, root = spec.filesystem()
    path = f"{root}/.orchestrator-probe-{secrets.token_hex(8)}"
    content = b"written by the driver"
    started = time.monotonic()
    with fs.open_output_stream(path) as f:
        f.write(content)
    with ThreadPoolExecutor(nodes) as pool:
        answers = list(pool.map(lambda _: reads_back(spec, path, content), range(nodes)))
    fs.delete_file(path)
    return {"nodes": nodes, "seconds": round(time.monotonic() - started, 3),
            "all_read_it": all(a is None for a in answers)}


def recorder_per_step(steps: int = 2000, points_per_report: int = 8) -> dict:
    """The real run recorder on a real (embedded) Ray: rank 0's reports, each carrying
    ``points_per_report`` steps (what four reports a second carry at 32 steps/s), and the
    driver's snapshot twice a second; the recorder's CPU per step, the snapshot's latency."""
    import os
    import tempfile

    import ray

    from orchestrator.driver.record import RunRecord
    from orchestrator.driver.recorder import start_recorder

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        folder = tempfile.mkdtemp(prefix="scale-recorder-")
        record = RunRecord("scale", "ddp", {}, "file:///tmp/x", started_at=time.time())
        recorder = start_recorder(os.path.join(folder, "run.json"), record,
                                  os.path.join(folder, "tb"), metrics=True, tracked=True)
        pid = ray.get(recorder.__ray_call__.remote(lambda self: os.getpid()))
        ray.get(recorder.group_started.remote(1024, 0, time.time(), steps))

        before, latencies, cursor, tracked = cpu_s(pid), [], 0, 0
        for first in range(1, steps + 1, points_per_report):
            points = [(s, {"loss": 1.0 / s}) for s in range(first, first + points_per_report)]
            recorder.progress.remote(points[-1][0], 32 * points_per_report, points[-1][1],
                                     time.time(), points)
            if first % (points_per_report * 2) == 1:  # the driver's poll
                asked = time.perf_counter()
                state = ray.get(recorder.snapshot.remote(cursor, tracked))
                latencies.append(time.perf_counter() - asked)
                cursor, tracked = state.cursor, state.tracked_cursor
        ray.get(recorder.snapshot.remote(cursor, tracked))
        used = cpu_s(pid) - before
    finally:
        ray.shutdown()
    latencies.sort()
    return {"steps": steps, "points_per_report": points_per_report,
            "recorder_cpu_ms_per_step": round(1000 * used / steps, 3),
            "snapshot_latency_ms_p50": round(1000 * latencies[len(latencies) // 2], 2),
            "snapshot_latency_ms_p99": round(1000 * latencies[int(len(latencies) * 0.99)], 2)}


PER_NODE = 8  # ranks a node: a GPU node's 8 (the local part is measured on one such node)


def agreement_rounds(sizes, rounds: int = 3, timeout_s: float = 60.0) -> list[dict]:
    """The preemption agreement at N ranks (PER_NODE a node), on a real (embedded) Ray, the
    real controller class's methods in an actor started as Ray Train starts its controller.
    Now (ray_internals/preemption_agreement.py): rank 0's answer and one call from each other
    node's poster into the controller (check_answers.py), all sent from one process; then, on
    every node at once, its other ranks read the answer from the node's folder
    (worker/node_answers.py): measured on one node, as threads. Before, and where the hooks
    are off, Ray's public calls: two barriers of one call per rank (get_preemption_info, then
    rank 0's broadcast), held as the controller holds them (controller_barrier.py), with room
    for every rank's call. Interleaved, the medians of ``rounds``. The notice reaches the ranks
    before it as the preemption watcher's one mark per worker, rank 0's first (here N calls
    to one actor standing in for the N workers)."""
    import statistics

    import ray

    from orchestrator.ray_internals.controller_barrier import room_for

    room_for(max(sizes))
    controller, workers, controller_cpu_s = agreement_actors(timeout_s)
    rows = []
    for world in sizes:
        took = {"first_mark": [], "marks": [], "per_node": [], "on_a_node": [],
                "two_rounds": []}
        cpu, error = {"per_node": [], "two_rounds": []}, None
        for _ in range(rounds):
            began = time.perf_counter()  # the watcher's marks, rank 0's first, as Ray sends them
            ray.get(workers.mark_preempt.remote("notice"))
            took["first_mark"].append(time.perf_counter() - began)
            for _rank in range(1, world):
                workers.mark_preempt.remote("notice")
            ray.get(workers.marks.remote())
            took["marks"].append(time.perf_counter() - began)
            took["on_a_node"].append(on_a_node(min(world, PER_NODE)))
            for kind, agree in (
                    ("per_node", lambda w=world: per_node_once(controller, nodes_of(w), timeout_s)),
                    ("two_rounds", lambda w=world: two_rounds_once(controller, w, timeout_s))):
                cpu_before = controller_cpu_s()
                seconds, error = agree()
                took[kind].append(seconds)
                cpu[kind].append(controller_cpu_s() - cpu_before)
                if seconds is None:
                    break
            if error:
                break

        def median(values):
            return round(statistics.median(values), 4) if values and None not in values else None

        rows.append({"ranks": world, "nodes": nodes_of(world),
                     **{f"{k}_s": median(v) for k, v in took.items()},
                     # what the controller's process spends on them: their time where every
                     # rank sends from a process of its own, not one process all
                     **{f"controller_cpu_{k}_s": median(v) for k, v in cpu.items()},
                     "all_answered": error is None, "error": error})
        if error:
            break
    return rows


def nodes_of(world: int) -> int:
    return -(-world // PER_NODE)


def agreement_actors(timeout_s: float):
    """The controller (the run's controller's own methods), the workers' stand-in, and a
    function reading the controller's CPU seconds."""
    import os

    import ray

    from orchestrator.ray_internals.controller_barrier import TrainController, _this_host

    @ray.remote(num_cpus=0)
    class Controller:  # as Ray Train starts its controller: num_cpus=0, nothing else
        async def new_barrier(self) -> int:
            return _this_host().new({"timeout_s": timeout_s}).key

        barrier_call = TrainController.barrier_call
        agreement_publish = TrainController.agreement_publish
        agreement_answer = TrainController.agreement_answer

        async def null_call(self, key: int, method: str, args: tuple, kwargs: dict) -> None:
            return None  # a barrier call's arguments, nothing done (per_call_cpu)

    @ray.remote(num_cpus=0)
    class Workers:
        def __init__(self):
            self.marked = 0

        def mark_preempt(self, info) -> None:
            self.marked += 1

        def marks(self) -> int:
            return self.marked

    controller, workers = Controller.remote(), Workers.remote()
    pid = ray.get(controller.__ray_call__.remote(lambda self: os.getpid()))
    return controller, workers, lambda: cpu_s(pid)


def failed(exc: Exception) -> tuple[None, str]:
    lines = str(exc).strip().splitlines()  # the barrier's timeout: some calls never came in
    return None, next((line for line in lines if "have not joined" in line), lines[-1])[:300]


def per_node_once(controller, nodes: int, timeout_s: float):
    """(seconds until rank 0's answer reached every other node's poster, None) or (None, why)."""
    import ray

    key = ray.get(controller.new_barrier.remote())
    began = time.perf_counter()
    try:
        answers = [controller.agreement_answer.remote(key, 1) for _ in range(nodes - 1)]
        ray.get(controller.agreement_publish.remote(key, 1, ("notice", (1, False, 0))))
        ray.get(answers, timeout=timeout_s + 30)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayTaskError) as exc:
        return failed(exc)
    return time.perf_counter() - began, None


def on_a_node(ranks: int) -> float:
    """Seconds from a node's poster posting an answer to the last of its other ``ranks`` - 1
    ranks reading it (worker/node_answers.py; they are waiting for it, as threads)."""
    import tempfile

    from orchestrator.worker.node_answers import Poster, Reader

    with tempfile.TemporaryDirectory(prefix="scale-node-") as base:
        poster = Poster("bench", "10.0.0.1", Path(base))
        readers = [Reader("bench", "10.0.0.1", Path(base)) for _ in range(ranks - 1)]
        read_at: list[float] = []
        threads = [threading.Thread(target=lambda r=r: (r.read(1, 60), read_at.append(
            time.perf_counter()))) for r in readers]
        for thread in threads:
            thread.start()
        time.sleep(0.05)  # every reader waiting
        posted = time.perf_counter()
        poster.post(1, ("notice", (1, False, 0)))
        for thread in threads:
            thread.join(60)
        poster.close()
    return max(read_at, default=posted) - posted


TWO_ROUNDS = ("ray.train.get_preemption_info", "ray.train.collective.broadcast_from_rank_zero")


def two_rounds_once(controller, world: int, timeout_s: float, callers=TWO_ROUNDS):
    """(seconds until every rank has the answer of each barrier in turn, None) or (None, the
    barrier's complaint)."""
    import ray

    from orchestrator.ray_internals.barrier_handle import HostedBarrier

    barrier = HostedBarrier(controller, ray.get(controller.new_barrier.remote()))
    began = time.perf_counter()
    try:
        for caller in callers:
            ray.get([barrier.broadcast_from_rank_zero.remote(
                world_rank=rank, world_size=world, data=("notice", (1, False, 0)) if rank == 0
                else None, caller_method_name=caller) for rank in range(world)],
                timeout=timeout_s + 30)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayTaskError) as exc:
        return failed(exc)
    return time.perf_counter() - began, None


def agreement_on_ray(sizes) -> dict:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        return {"rows": agreement_rounds(sizes), "per_call": per_call_cpu(max(sizes))}
    finally:
        ray.shutdown()


def per_call_cpu(world: int, rounds: int = 3) -> dict:
    """What one call costs the process it enters, in CPU milliseconds, for ``world`` calls at
    once: a call that does nothing (an async actor's, as the controller's), a barrier in Ray
    Train's own actor, one held as a run's controller holds it (the hop to its loop thread
    added), and a node's call for rank 0's answer (check_answers.py). The medians of
    ``rounds``."""
    import os
    import statistics

    import ray

    from orchestrator.ray_internals.controller_barrier import RaySynchronizationActor

    controller, _, controller_cpu_s = agreement_actors(60.0)
    rays = RaySynchronizationActor.options(max_concurrency=world + 100).remote(timeout_s=60)
    rays_pid = ray.get(rays.__ray_call__.remote(lambda self: os.getpid()))

    def null():
        ray.get([controller.null_call.remote(0, "broadcast_from_rank_zero", (), {})
                 for _ in range(world)])

    def rays_barrier():
        ray.get([rays.broadcast_from_rank_zero.remote(
            world_rank=rank, world_size=world, data=None, caller_method_name="x")
            for rank in range(world)])

    def ms_per_call(call, cpu) -> float:
        spent = []
        for _ in range(rounds):
            before = cpu()
            call()
            spent.append(cpu() - before)
        return round(1000 * statistics.median(spent) / world, 2)

    return {"ranks": world,
            "null_call_ms": ms_per_call(null, controller_cpu_s),
            "rays_barrier_ms": ms_per_call(rays_barrier, lambda: cpu_s(rays_pid)),
            "controllers_barrier_ms": ms_per_call(lambda: two_rounds_once(
                controller, world, 60.0, TWO_ROUNDS[:1]), controller_cpu_s),
            "answer_call_ms": ms_per_call(lambda: per_node_once(controller, world, 60.0),
                                          controller_cpu_s)}


def fitted_exponent(points: list[tuple[int, float]]) -> float | None:
    """The slope of log(value) against log(N), between the smallest and largest N."""
    import math

    (n0, v0), (n1, v1) = points[0], points[-1]
    if v0 <= 0 or v1 <= 0:
        return None
    return round(math.log(v1 / v0) / math.log(n1 / n0), 2)


PARTS = ("checkpoint", "probe", "record", "recorder", "agreement")


def run(args: argparse.Namespace, work: Path) -> dict:
    parts = getattr(args, "scale_parts", PARTS)
    sizes = getattr(args, "scale_sizes", SIZES)
    result: dict = {"figures": {}}
    if "checkpoint" in parts or "probe" in parts:
        result.update(on_the_store(parts, sizes, work))
    if "record" in parts:
        result["run_record"] = record = run_record_size()
        result["figures"]["run_json_bytes_after_1000_attempts"] = figure(record["bytes"],
                                                                          Goal("<=", 2**20))
    if "recorder" in parts:
        progress("scale: the recorder's CPU per reported step")
        result["recorder"] = recorder = recorder_per_step()
        # rank 0 alone reports, whatever the world size: per step, not per rank and step
        result["figures"]["recorder_cpu_ms_per_step"] = figure(
            recorder["recorder_cpu_ms_per_step"], Goal("<=", 5.0))
    if "agreement" in parts:
        progress("scale: the preemption agreement")
        result["agreement"] = agreement = agreement_on_ray(sizes)
        result["figures"]["agreement_after_notice_s"] = after_notice(agreement["rows"][-1])
    return result


def after_notice(agreed: dict):
    """From a notice to every rank agreeing: rank 0's mark (the one the agreement reads; the
    watcher sends the rest meanwhile), the wait for the next check (at most
    failure.preemption_check_s, 1 s by default, or longer where the other nodes wait long for
    rank 0's answer: worker/preemption_checks.py), the answer reaching every node's poster,
    and the node's other ranks reading it (every node at once)."""
    if not agreed["all_answered"]:
        return figure(None, Goal("<=", 2.0), ranks=agreed["ranks"])
    seconds = (agreed["first_mark_s"] + check_period(CHECK_EVERY_S, agreed["per_node_s"])
               + agreed["per_node_s"] + agreed["on_a_node_s"])
    return figure(round(seconds, 3), Goal("<=", 2.0), ranks=agreed["ranks"],
                  ranks_per_node=PER_NODE)


def on_the_store(parts, sizes, work: Path) -> dict:
    from scripts.s3_server import SeaweedS3

    result: dict = {"figures": {}}
    server = SeaweedS3(work / "seaweed").start()
    try:
        server.filesystem().create_dir("scale-bench")
        if "checkpoint" in parts:
            rows = []
            for world in sizes:
                progress(f"scale: one checkpoint of {world} ranks")
                rows.append(one_checkpoint(server, world, work))
            result.update(rows=rows, growth=checkpoint_growth(rows))
            result["figures"].update(checkpoint_figures(rows[-1]))
        if "probe" in parts:
            progress("scale: the storage probe for 10 and 100 nodes")
            result["probes"] = probes = [probe_time(server, n) for n in (10, 100)]
            result["figures"]["probe_100_nodes_s"] = figure(probes[-1]["seconds"],
                                                            Goal("<=", 10.0))
    finally:
        server.stop(kill=True)
    return result


def checkpoint_growth(rows: list[dict]) -> dict:
    return {"store_calls": fitted_exponent([(r["ranks"], r["store_calls"]) for r in rows]),
            "commit_after_last_part_s": fitted_exponent(
                [(r["ranks"], max(r["commit_after_last_part_s"], 1e-3)) for r in rows])}


def checkpoint_figures(largest: dict) -> dict:
    return {"commit_after_last_part_s": figure(largest["commit_after_last_part_s"],
                                               Goal("<=", 2.0), ranks=largest["ranks"]),
            "store_calls_per_rank": figure(largest["store_calls_per_rank"], Goal("<=", 20),
                                           ranks=largest["ranks"]),
            "rank0_part_records_read_per_rank": figure(
                largest["rank0_part_records_read"] / largest["ranks"], Goal("<=", 1.0))}
