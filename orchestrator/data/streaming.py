"""Whether a run streams its parquet data, and everything decided for it on the driver: the
manifests (footers), the virtual shard count, the label classes and the feature scaling.

data.stream=auto streams data larger than data.stream_above_mb decoded; smaller data keeps
the exact full shuffle of the in-memory path (orchestrator/data/order.py). A resume keeps the
checkpoint's shard count, and refuses data that changed since (data.on_change).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from orchestrator.config.schema import DataConfig
from orchestrator.data.manifest import Manifest, feature_columns, read_manifest, what_changed
from orchestrator.data.row_split import held_out
from orchestrator.data.stream_order import StreamOrder
from orchestrator.data.stream_reader import Decoding, EvalShare, GroupReader, RankStream
from orchestrator.errors import ConfigError
from orchestrator.storage.location import StorageSpec

log = logging.getLogger("orchestrator")
SAMPLE_GROUPS = 4  # row groups read on the driver for the feature scaling and the bins
MAX_BINS = 255  # histogram bins a feature gets from the sample's quantiles (boosting)


@dataclass(frozen=True)
class StreamPlan:
    manifest: Manifest
    eval_manifest: Manifest | None  # data.eval_path
    decoding: Decoding
    shards: int
    window: int
    data: StorageSpec  # where data.path is, reached with the run's credentials
    eval_data: StorageSpec | None
    seed: int
    test_fraction: float
    # Per feature, the upper bounds of its histogram bins, from the quantiles of the sample
    # (unscaled): the same for every worker and world size (LightGBM's forced bins).
    bin_bounds: tuple[tuple[float, ...], ...] = ()

    def order(self, global_batch: int) -> StreamOrder:
        return StreamOrder(self.manifest, self.seed, global_batch, self.shards, self.window,
                           self.test_fraction, self.eval_manifest is not None)

    def rank_stream(self, order: StreamOrder, rank: int, world_size: int) -> RankStream:
        fs, _ = self.data.filesystem()
        return RankStream(order, GroupReader(self.manifest, fs, self.decoding), rank, world_size)

    def eval_share(self, order: StreamOrder, rank: int, world_size: int, batch_size: int,
                   decoding: Decoding | None = None) -> EvalShare:
        """This rank's held-out rows; every rank gets the same number of batches.
        ``decoding``: another than the plan's (boosting's, unscaled)."""
        decoding = decoding or self.decoding
        if self.eval_manifest is None:
            per_rank = [[g for v in order.shards_of(r, world_size) for g in order.dealt[v]]
                        for r in range(world_size)]
            rows = [sum(order.test_rows[g] for g in gs) for gs in per_rank]
            fs, _ = self.data.filesystem()
            reader = GroupReader(self.manifest, fs, decoding)
            groups = sorted(per_rank[rank])
            masks = lambda g: ~order.train_mask(g)  # noqa: E731
        else:
            n = len(self.eval_manifest.groups)
            per_rank = [list(range(r, n, world_size)) for r in range(world_size)]
            rows = [sum(self.eval_manifest.groups[g].rows for g in gs) for gs in per_rank]
            fs, _ = self.eval_data.filesystem()
            reader = GroupReader(self.eval_manifest, fs, decoding)
            groups = per_rank[rank]
            masks = lambda g: slice(None)  # noqa: E731
        count = max(-(-r // batch_size) for r in rows)
        return EvalShare(reader, groups, masks, batch_size, count)


class DataShare:
    """A rank's rows of streamed parquet without a batch order (boosting): its virtual
    shards' row groups, read one at a time, features unscaled."""

    def __init__(self, plan: StreamPlan, rank: int, world_size: int):
        from dataclasses import replace

        self.plan, self.rank, self.world = plan, rank, world_size
        self.order = plan.order(plan.shards)  # the deal of row groups: no batch involved
        self.groups = sorted(g for v in self.order.shards_of(rank, world_size)
                             for g in self.order.dealt[v])
        self.decoding = replace(plan.decoding, mean=None, std=None)
        fs, _ = plan.data.filesystem()
        self.reader = GroupReader(plan.manifest, fs, self.decoding)

    @property
    def num_classes(self) -> int:
        return len(self.decoding.classes) if self.decoding.classes is not None else 0

    def position(self, step: int) -> dict:
        """What a checkpoint keeps: the data's manifest, so a resume over changed data is
        refused; no shard count (a resume at another size deals the row groups anew)."""
        return {"streamed": True, "next_step": step, "manifest": self.plan.manifest.summary()}

    @property
    def rows(self) -> int:
        return sum(self.order.train_rows[g] for g in self.groups)

    @property
    def bin_bounds(self) -> tuple[tuple[float, ...], ...]:
        """Per feature, histogram bin upper bounds decided on the driver (StreamPlan)."""
        return self.plan.bin_bounds

    def train_rows(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) of row group ``g``'s training rows."""
        x, y = self.reader.read(g)
        keep = self.order.train_mask(g)
        return x[keep], y[keep]

    def train_chunks(self):
        """(x, y) of each of this rank's row groups' training rows."""
        for g in self.groups:
            yield self.train_rows(g)

    def test_chunks(self, rows: int = 65536):
        """(x, y) of this rank's held-out rows, in chunks of up to ``rows``."""
        for x, y, weight in self.plan.eval_share(self.order, self.rank, self.world, rows,
                                                 self.decoding):
            if weight:
                yield x, y


def stream_wanted(cfg: DataConfig, manifest: Manifest) -> bool:
    if cfg.stream == "auto":
        return manifest.memory > cfg.stream_above_mb * 2**20
    return cfg.stream == "true"


def plan_stream(cfg: DataConfig, storage: StorageSpec, seed: int, trainer: str | None,
                workers: int, global_batch: int | None, task: str,
                resumed: dict | None, content_changed: bool | None = None) -> StreamPlan | None:
    """None where the run keeps its data in memory. ``trainer``: its name where its training
    function does not stream (None where it does). ``resumed``: the data position of the
    checkpoint the run resumes from. ``content_changed``: whether the data's content differs
    from the checkpoint's (orchestrator/data/fingerprint.py: the run plan refused or allowed
    it), None where that is not known: then the files' sizes and times judge."""
    if cfg.name != "parquet" or cfg.stream == "false":
        return None
    if trainer is not None:  # decided before any footer is read
        if cfg.stream == "true":
            raise ConfigError(f"data.stream=true: trainer={trainer} reads its data whole; "
                              "streamed data is for training functions that read it through "
                              "ctx.stream() or ctx.share() (ddp, fsdp, mwms, xgboost, lightgbm)")
        return None
    data = storage.sibling(cfg.path, "data.path")
    fs, path = data.filesystem()
    manifest = read_manifest(fs, path, cfg.label, "data.path", cfg.max_row_group_mb, cfg.columns)
    before = resumed if resumed and resumed.get("streamed") else None
    change = judged_change(cfg, before, manifest, content_changed)
    # data.stream=auto resumes as the checkpoint read its data (streamed or held), whatever the
    # data's size is now: the two orders differ.
    wanted = (before is not None if resumed and cfg.stream == "auto" and not change
              else stream_wanted(cfg, manifest))
    if not wanted:
        return None
    eval_data = eval_manifest = None
    if cfg.eval_path:
        eval_data = storage.sibling(cfg.eval_path, "data.eval_path")
        efs, epath = eval_data.filesystem()
        eval_manifest = read_manifest(efs, epath, cfg.label, "data.eval_path", cfg.max_row_group_mb,
                                      cfg.columns)
        used = [*feature_columns(manifest.columns, manifest.label, cfg.columns, cfg.path),
                manifest.label]
        missing = [c for c in used if c not in eval_manifest.columns]
        if missing:
            raise ConfigError(f"data.eval_path={cfg.eval_path!r}: it lacks columns the model reads "
                              f"from data.path ({', '.join(missing)})")
    kept = before is not None and "shards" in before  # a batch order's shards (not boosting's)
    shards = before["shards"] if kept else (cfg.shards or workers)
    check_shards(cfg, shards, workers, len(manifest.groups), global_batch, kept)
    if global_batch is not None:
        check_epoch(cfg, StreamOrder(manifest, seed, global_batch, shards, cfg.window,
                                     cfg.test_fraction, eval_manifest is not None))
    decoding, bounds = decide_decoding(fs, manifest, cfg, seed, task)
    if eval_manifest is not None and decoding.classes is not None:
        unknown = sorted(set(label_values(eval_data.filesystem()[0], eval_manifest))
                         - set(decoding.classes), key=str)
        if unknown:
            raise ConfigError(f"data.eval_path={cfg.eval_path!r}: label values that data.path "
                              f"does not have ({', '.join(map(repr, unknown[:3]))}): a model "
                              "trained there has no class for them")
    return StreamPlan(manifest, eval_manifest, decoding, shards, cfg.window, data, eval_data, seed,
                      cfg.test_fraction, bounds)


def judged_change(cfg: DataConfig, before: dict | None, manifest: Manifest,
                  content_changed: bool | None) -> str | None:
    """How the data differs from a streamed checkpoint's, or None: by content where the run
    plan compared it, else by the files' sizes and times (a checkpoint without digests)."""
    if content_changed is not None:
        return "its content" if content_changed and before else None
    change = what_changed(before["manifest"], manifest) if before else None
    if change and cfg.on_change == "refuse":
        raise ConfigError(
            f"data.path={cfg.path!r} changed since the checkpoint this run resumes from "
            f"({change}): its order and split would differ; set data.on_change=continue to "
            "go on with the data as it is now, or start a new run (run.name)")
    return change


def check_shards(cfg: DataConfig, shards: int, workers: int, groups: int,
                 global_batch: int | None, resumed: bool) -> None:
    source = "the checkpoint's shard count" if resumed else "data.shards"
    if shards < workers:
        way_out = (f": resume with cluster.workers<={shards}, or start a new run (run.name)"
                   if resumed else "")
        raise ConfigError(f"{source}={shards} is fewer than cluster.workers={workers}: a worker "
                          f"would have no data (each streams whole virtual shards){way_out}")
    if groups < shards:
        raise ConfigError(f"data.path={cfg.path!r} has {groups} row groups, fewer than "
                          f"{shards} virtual shards ({source}, null: cluster.workers): write "
                          "it with more row groups, stream fewer shards, or hold it in memory "
                          "(data.stream=false)")
    if global_batch is not None and global_batch < shards:
        raise ConfigError(f"trainer.batch_size={global_batch} is smaller than the {shards} "
                          f"virtual shards ({source}): each gives the global batch a row or more")


LEFT_OVER_WARNING = 0.1  # of an epoch's training rows


def check_epoch(cfg: DataConfig, order: StreamOrder) -> None:
    """Every shard gives the global batch its rows at each step, so the shortest shard ends
    the epoch: whole row groups dealt unevenly leave rows of the others for a later epoch.
    None at all is refused; more than a tenth is said once."""
    shortest = min(range(order.shards), key=lambda v: order.shard_rows[v] // order.per_step[v])
    where = (f"data.path={cfg.path!r}: its {len(order.manifest.groups)} row groups dealt to "
             f"{order.shards} virtual shards (data.shards, null: cluster.workers)")
    if order.steps_per_epoch == 0:
        raise ConfigError(
            f"{where} give shard {shortest} {order.shard_rows[shortest]} training rows, fewer "
            f"than the {order.per_step[shortest]} it gives each global batch "
            f"(trainer.batch_size={order.global_batch}): not one step an epoch; use a smaller "
            "trainer.batch_size, fewer shards, more row groups, or data.stream=false")
    left = 1 - order.steps_per_epoch * order.global_batch / order.num_rows
    if left > LEFT_OVER_WARNING:
        # Shards are dealt equal rows, but a batch they do not divide asks one more row a step
        # of some of them, which run out first.
        uneven = (f", or a trainer.batch_size the {order.shards} shards divide (now "
                  f"{order.global_batch})" if order.global_batch % order.shards else "")
        log.warning("%s leave %.0f%% of the training rows out of each epoch (shard %d has %d, "
                    "the largest %d): write smaller row groups%s, or data.stream=false",
                    where, 100 * left, shortest, order.shard_rows[shortest], max(order.shard_rows),
                    uneven)


def decide_decoding(fs, manifest: Manifest, cfg: DataConfig, seed: int, task: str,
                    ) -> tuple[Decoding, tuple[tuple[float, ...], ...]]:
    """Label classes from the label column (one column, all row groups); feature scaling
    and histogram bins from the training rows of a few row groups spread over the data."""
    classes = tuple(sorted(label_values(fs, manifest))) if task != "regression" else None
    picks = np.unique(np.linspace(0, len(manifest.groups) - 1, SAMPLE_GROUPS).round().astype(int))
    sample = []
    features = feature_columns(manifest.columns, manifest.label, cfg.columns, cfg.path)
    plain = Decoding(features, manifest.label, classes, None, None)  # labels as classes
    for g in picks:
        grp = manifest.groups[g]
        with fs.open_input_file(manifest.files[grp.file].path) as handle:
            table = pq.ParquetFile(handle).read_row_group(grp.index, columns=[*features, manifest.label])
        x, _ = plain.decode(table)
        ids = np.arange(grp.first_row, grp.first_row + grp.rows)
        sample.append(x if cfg.eval_path else x[~held_out(ids, seed, cfg.test_fraction)])
    x = np.concatenate(sample)
    # A NaN (data.allow_nonfinite, or past the driver's count) stays in its own row only.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a column of NaN alone, or no rows
        mean, std = np.nanmean(x, 0), np.nanstd(x, 0)
    mean = np.nan_to_num(mean, nan=0.0)
    std = np.where(~(std >= 1e-6), 1.0, std).astype(np.float32)
    return (Decoding(features, manifest.label, classes, mean.astype(np.float32), std),
            bin_bounds(x))


def label_values(fs, manifest: Manifest) -> list:
    """The distinct values of the label column, one file at a time."""
    found = []
    for f in manifest.files:
        with fs.open_input_file(f.path) as handle:
            column = pq.ParquetFile(handle).read(columns=[manifest.label])[manifest.label]
        found.append(pc.unique(column))
    return pc.unique(pa.concat_arrays(found)).drop_null().to_pylist()


def bin_bounds(x: np.ndarray, bins: int = MAX_BINS) -> tuple[tuple[float, ...], ...]:
    """Each column's bin upper bounds: its distinct quantiles, the largest value left out
    (the last bin is open)."""
    cuts = np.linspace(0, 1, bins + 1)[1:-1]
    return tuple(tuple(float(v) for v in np.unique(np.quantile(column[np.isfinite(column)], cuts)))
                 if np.isfinite(column).any() else () for column in x.T)

