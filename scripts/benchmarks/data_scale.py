"""Data larger than one worker: the PyTorch trainer (trainer=ddp, 2 workers) on parquet
datasets of ~1 GiB and ~8 GiB on disk (64 float32 features and a label; files of 512Ki rows in
row groups of 128Ki), streamed (data.stream=true) and held in memory (data.stream=false, the
whole dataset on every worker: 1 GiB only).

Figures: peak RSS per training worker (VmHWM, the process tree polled) at 8 GiB / at 1 GiB
streamed (goal <= 1.15) and at 8 GiB (goal < 1.5 GiB), against the in-memory run at 1 GiB;
bytes read per rank in one epoch at 1 GiB / (total / world) (goal <= 1.25); steady samples/s
streamed / in memory on the same data and steps (goal >= 0.95); and a rank's read of its
share through the orchestrator's reader / a bare pyarrow read of the same row groups (goal
>= 0.8). The datasets are written once into the work folder and reused.

The boosting legs (--data-parts boosting): XGBoost (QuantileDMatrix, and external memory) and
LightGBM streaming the largest dataset on 2 workers for a few rounds; peak RSS per worker above
the same command's on a tiny dataset (the idle worker), over the dataset's features held as
float32 (goal <= 0.75: each holds about half).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from scripts.benchmarks.common import (
    Goal,
    figure,
    median,
    orchestrator_cmd,
    order_for,
    progress,
    ratio,
    read_json,
)
from scripts.benchmarks.memory import run_watched

FEATURES, FILE_ROWS, GROUP_ROWS = 64, 512 * 1024, 128 * 1024
BYTES_PER_ROW = (FEATURES + 2) * 4  # float32 noise barely compresses: ~264 bytes a row on disk


def write_dataset(folder: Path, gib: float, group_rows: int = GROUP_ROWS) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = folder / "_done"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rows = int(gib * 2**30 / BYTES_PER_ROW)
    rng = np.random.default_rng(0)
    w = rng.normal(size=FEATURES).astype(np.float32)
    for f, start in enumerate(range(0, rows, FILE_ROWS)):
        n = min(FILE_ROWS, rows - start)
        x = rng.normal(size=(n, FEATURES)).astype(np.float32)
        label = (x @ w + rng.normal(scale=2.0, size=n) > 0).astype(np.int64)
        table = pa.table({**{f"f{i}": x[:, i] for i in range(FEATURES)}, "label": label})
        pq.write_table(table, folder / f"part-{f:04d}.parquet", row_group_size=group_rows,
                       compression="snappy", use_dictionary=False)
    done.write_text(str(rows))
    return folder


def train(work: Path, name: str, data: Path, stream: bool, steps: int, batch: int) -> dict:
    run_dir = work / name
    cmd = orchestrator_cmd(run_dir, "trainer=ddp", "data=parquet", f"data.path={data}",
                           f"data.stream={'true' if stream else 'false'}", "cluster.workers=2",
                           f"trainer.batch_size={batch}", f"trainer.max_steps={steps}",
                           "trainer.epochs=100", "checkpoint.every_steps=null",
                           "log.progress=lines", "log.metrics=false", "resume=never")
    progress(f"data_scale: {name}")
    timed, peaks = run_watched(cmd, work / f"{name}.log", timeout=3600)
    record = read_json(run_dir / "run.json")
    return {"wall_s": round(timed.wall_s, 1),
            "worker_peak_mib": peaks["train_workers_mib"][:2],
            "steady_samples_per_s": record.get("samples_per_s"),
            "data": record.get("data"), "metrics": record.get("metrics")}


# The boosting legs: each framework streaming its share of the large dataset (issue 28's
# "each holds about half"), against the same command on a tiny dataset (the idle worker).
BOOSTERS = {"xgboost": ["trainer=xgboost"],
            "xgboost_external": ["trainer=xgboost", "trainer.external_memory=true"],
            "lightgbm": ["trainer=lightgbm"]}


def boost(work: Path, name: str, data: Path, booster: str, rounds: int) -> dict:
    run_dir = work / name
    cmd = orchestrator_cmd(run_dir, *BOOSTERS[booster], "data=parquet", f"data.path={data}",
                           "data.stream=true", "cluster.workers=2",
                           f"trainer.num_boost_round={rounds}", "checkpoint.every_steps=null",
                           "log.progress=lines", "log.metrics=false", "resume=never")
    progress(f"data_scale: {name}")
    timed, peaks = run_watched(cmd, work / f"{name}.log", timeout=3600)
    record = read_json(run_dir / "run.json")
    return {"wall_s": round(timed.wall_s, 1), "worker_peak_mib": peaks["train_workers_mib"][:2],
            "metrics": record.get("metrics")}


def boosting(args: argparse.Namespace, work: Path, data: Path) -> dict:
    """Peak RSS per worker above the idle one, over the dataset's size as float32 features."""
    tiny = write_dataset(Path(args.data_dir or work) / "data-tiny", 0.001, group_rows=1024)
    rows = int((data / "_done").read_text())
    in_memory_mib = rows * FEATURES * 4 / 2**20
    legs, figures = {}, {}
    for booster in args.data_boosters:
        idle = boost(work, f"{booster}-tiny", tiny, booster, args.data_boost_rounds)
        large = boost(work, f"{booster}-large", data, booster, args.data_boost_rounds)
        above = max(large["worker_peak_mib"]) - max(idle["worker_peak_mib"])
        legs[booster] = {"idle": idle, "large": large, "above_idle_mib": round(above)}
        goal = None if booster == "xgboost_external" else Goal("<=", 0.75)  # external: "well under"
        figures[f"{booster}_peak_above_idle_over_data"] = figure(ratio(above, in_memory_mib), goal)
    return {"data_in_memory_mib": round(in_memory_mib), "rounds": args.data_boost_rounds,
            "runs": legs, "figures": figures}


def read_rates(data: Path, repeats: int = 5) -> dict:
    """Rank 0 of 2's share of one epoch: the orchestrator's reader vs bare pyarrow, in
    interleaved pairs (this machine is noisy): medians and each pair."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    from orchestrator.config.schema import DataConfig
    from orchestrator.data import stream_reader
    from orchestrator.data.streaming import plan_stream
    from orchestrator.storage.location import StorageSpec

    cfg = DataConfig(name="parquet", path=str(data), stream="true")
    plan = plan_stream(cfg, StorageSpec(str(data)), 0, None, 2, 1024, "classification", None)
    order = plan.order(1024)
    groups = [g for v in order.shards_of(0, 2) for g in order.dealt[v]]
    fs = pafs.LocalFileSystem()
    columns = list(plan.manifest.columns)

    def bare() -> None:
        for g in groups:
            grp = plan.manifest.groups[g]
            with fs.open_input_file(plan.manifest.files[grp.file].path) as handle:
                pq.ParquetFile(handle).read_row_group(grp.index, columns=columns)

    def ours() -> int:
        stream = plan.rank_stream(order, 0, 2)
        return sum(len(ids) for ids, _, _ in stream.steps(0, order.steps_per_epoch))

    def ours_numpy() -> int:  # the decode without its compiled part (no C compiler at install)
        compiled, stream_reader.rows_from_columns = stream_reader.rows_from_columns, None
        try:
            return ours()
        finally:
            stream_reader.rows_from_columns = compiled

    rows = 0
    times: dict[str, list[float]] = {"bare_pyarrow_s": [], "orchestrator_s": []}
    sides = {"bare_pyarrow_s": bare, "orchestrator_s": ours}
    if stream_reader.rows_from_columns is not None:
        times["orchestrator_numpy_decode_s"] = []
        sides["orchestrator_numpy_decode_s"] = ours_numpy
    for repeat in range(repeats):
        for name in order_for(repeat, list(times)):
            started = time.perf_counter()
            rows = sides[name]() or rows
            times[name].append(round(time.perf_counter() - started, 3))
    bare_s, ours_s = median(times["bare_pyarrow_s"]), median(times["orchestrator_s"])
    result = {"rows": rows, "bare_pyarrow_s": bare_s, "orchestrator_s": ours_s,
              "ratio": ratio(bare_s, ours_s), "each": times}
    if "orchestrator_numpy_decode_s" in times:
        numpy_s = median(times["orchestrator_numpy_decode_s"])
        result.update(orchestrator_numpy_decode_s=numpy_s, ratio_numpy_decode=ratio(bare_s, numpy_s))
    return result


def run(args: argparse.Namespace, work: Path) -> dict:
    sizes = [float(s) for s in args.data_gib.split(",")]
    small, large = sizes[0], sizes[-1]
    datasets = {gib: write_dataset(Path(args.data_dir or work) / f"data-{gib:g}gib", gib)
                for gib in sizes}
    if args.data_parts == ["reads"]:  # the reader alone, against a bare pyarrow read
        reads = read_rates(datasets[small], repeats=max(5, args.repeats))
        return {"read_rates": reads, "figures": {
            "read_rate_over_bare_pyarrow": figure(reads["ratio"], Goal(">=", 0.8))}}
    if "torch" not in args.data_parts:
        return boosting(args, work, datasets[large])
    steps, batch = args.data_steps, args.data_batch
    # Streamed vs in memory, interleaved (A B, B A, ...): samples/s is compared by medians.
    pairs: dict[str, list[dict]] = {"memory_small": [], "stream_small": []}
    for repeat in range(max(1, args.repeats)):
        for name in order_for(repeat, list(pairs)):
            pairs[name].append(train(work, f"{name}-{repeat}", datasets[small],
                                     name.startswith("stream"), steps, batch))
    runs = {name: done[0] for name, done in pairs.items()}
    rates = {name: median([r["steady_samples_per_s"] for r in done]) for name, done in pairs.items()}
    if large != small:
        runs["stream_large"] = train(work, "stream_large", datasets[large], True, steps, batch)
    # One epoch at the small size, for the bytes each rank reads in it.
    rows = int((datasets[small] / "_done").read_text())
    epoch = int(rows * 0.8 / batch) - 2
    runs["stream_small_epoch"] = train(work, "stream_small_epoch", datasets[small], True, epoch, batch)
    reads = read_rates(datasets[small], repeats=max(5, args.repeats))

    def peak(name):
        return max(runs[name]["worker_peak_mib"]) if name in runs else None

    epoch_data = runs["stream_small_epoch"]["data"] or {}
    per_rank = [r["bytes_read"] for r in epoch_data.get("ranks", {}).values()]
    share = epoch_data.get("bytes", 0) / 2
    boosted = boosting(args, work, datasets[large]) if "boosting" in args.data_parts else None
    return {
        "sizes_gib": sizes, "steps": steps, "batch": batch, "runs": runs, "read_rates": reads,
        "boosting": boosted,
        "figures": {
            "peak_rss_large_over_small": figure(ratio(peak("stream_large"), peak("stream_small")),
                                                Goal("<=", 1.15)),
            "peak_rss_large_gib": figure(round(peak("stream_large") / 1024, 3)
                                         if peak("stream_large") else None, Goal("<=", 1.5)),
            "peak_rss_streamed_over_in_memory_small": figure(
                ratio(peak("stream_small"), peak("memory_small"))),
            "bytes_read_per_rank_epoch_over_share": figure(
                ratio(max(per_rank), share) if per_rank and share else None, Goal("<=", 1.25)),
            "samples_per_s_streamed_over_in_memory": figure(
                ratio(rates["stream_small"], rates["memory_small"]), Goal(">=", 0.95),
                each={name: [r["steady_samples_per_s"] for r in done] for name, done in pairs.items()}),
            "read_rate_over_bare_pyarrow": figure(reads["ratio"], Goal(">=", 0.8)),
        },
    }
