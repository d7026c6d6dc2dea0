"""The bundled real dataset (scikit-learn's digits), a seeded synthetic one, and parquet.

Every worker loads the same arrays and the same train/test split (keyed by the seed);
which rows a worker trains on is decided by orchestrator.data.order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from orchestrator.config.schema import DataConfig
from orchestrator.data.manifest import (
    check_numeric,
    feature_columns,
    same_columns,
    schema_difference,
)
from orchestrator.errors import ConfigError, one_line
from orchestrator.storage.location import StorageSpec


@dataclass(frozen=True)
class Dataset:
    x_train: np.ndarray  # float32, (rows, features)
    y_train: np.ndarray  # int64 class ids, or float32 targets (regression)
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int  # 0 for regression
    feature_names: tuple[str, ...]
    task: str = "classification"

    @property
    def num_features(self) -> int:
        return self.x_train.shape[1]


@dataclass(frozen=True)
class DataFacts:
    """What a model needs to know of tabular data (interpolated as ${data.features} etc.)."""

    features: int
    outputs: int  # the number of classes, or 1 for regression
    task: str


def data_facts(cfg: DataConfig, storage: StorageSpec | None = None,
               opened=None) -> DataFacts | None:
    """The shape of a built-in dataset, found cheaply on the driver (a parquet file's schema
    and label column; ``opened``: its dataset, if check_parquet opened it already); None for
    data=torch (the user's datasets say themselves)."""
    if cfg.name == "digits":
        return DataFacts(64, 10 if cfg.task != "regression" else 1, cfg.task or "classification")
    if cfg.name == "synthetic":
        task = cfg.task or "classification"
        return DataFacts(cfg.features, cfg.classes if task == "classification" else 1, task)
    if cfg.name == "parquet":
        dataset = opened if opened is not None else check_parquet(cfg, storage)
        rows = dataset.count_rows()  # from the footers
        if rows < 2:  # one row to train on and one held out, at the least
            raise ConfigError(f"data.path={cfg.path!r}: {rows} rows; training needs 2 or more")
        label_type = dataset.schema.field(cfg.label).type
        task = parquet_task(cfg, label_type)
        if task == "regression" and not (pa.types.is_integer(label_type) or
                                         pa.types.is_floating(label_type) or
                                         pa.types.is_decimal(label_type)):
            raise ConfigError(f"data.task=regression: the label column {cfg.label!r} holds "
                              f"{label_type}, not numbers: data.task=classification for classes")
        outputs = 1
        if task == "classification":
            values = distinct_labels(dataset, cfg.label)
            outputs = len(values)
            if outputs < 2:
                raise ConfigError(
                    f"data.label={cfg.label!r}: the label column of data.path={cfg.path!r} holds "
                    f"{'one value (' + repr(values[0].as_py()) + ')' if outputs else 'no value'}: "
                    "a classifier needs two classes or more; a number to predict is "
                    "data.task=regression")
            if cfg.eval_path:  # its classes must be data.path's (the workers found out, in memory)
                held_out = check_parquet(eval_config(cfg), storage, "data.eval_path")
                unknown = sorted(set(distinct_labels(held_out, cfg.label).to_pylist())
                                 - set(values.to_pylist()), key=str)
                if unknown:
                    raise ConfigError(
                        f"data.eval_path={cfg.eval_path!r}: label values that data.path does not "
                        f"have ({', '.join(map(repr, unknown[:3]))}): a model trained there has "
                        "no class for them")
        features = feature_columns(dataset.schema.names, cfg.label, cfg.columns, cfg.path)
        return DataFacts(len(features), outputs, task)
    return None


def distinct_labels(dataset, label: str) -> pa.Array:
    """The label column's distinct values but null, read a batch at a time: data of any size."""
    import pyarrow.compute as pc

    found = [pc.unique(b.column(0)) for b in dataset.to_batches(columns=[label])]
    return pc.unique(pa.concat_arrays(found)).drop_null()


def parquet_task(cfg: DataConfig, label_type: pa.DataType) -> str:
    if cfg.task is not None:
        return cfg.task
    if pa.types.is_floating(label_type) or pa.types.is_decimal(label_type):
        raise ConfigError(
            f"data.task: the label column {cfg.label!r} holds {label_type} numbers, which may be "
            "a regression target or class ids: set data.task=regression or data.task=classification")
    return "classification"


def load_dataset(cfg: DataConfig, seed: int, storage: StorageSpec | None = None) -> Dataset:
    task = cfg.task or "classification"
    if cfg.name == "digits":
        x, y = digits()
        x = x.astype(np.float32) / 16.0
        names = tuple(f"pixel_{i}" for i in range(x.shape[1]))
    elif cfg.name == "synthetic":
        x, y = synthetic(cfg.rows, cfg.features, cfg.classes, seed, task)
        names = tuple(f"f{i}" for i in range(cfg.features))
    elif cfg.name == "parquet":
        x, y, names, task, values = read_parquet(cfg, storage)
        if cfg.eval_path:  # every row of data.path trains; data.eval_path's are held out
            x_test, y_test, test_names, _, _ = read_parquet(eval_config(cfg), storage,
                                                              "data.eval_path", values)
            if test_names != names:
                raise ConfigError(f"data.eval_path={cfg.eval_path!r}: its columns differ from "
                                  f"data.path's ({', '.join(test_names)})")
            classes = len(values) if values is not None else 0
            return Dataset(x, y, x_test, y_test, classes, tuple(names), task)
    else:
        raise ConfigError("data=torch: your datasets come from data.train/data.eval, not "
                          "ctx.dataset() (which loads digits, synthetic and parquet)")
    return split(x, y, cfg.test_fraction, seed, names, task)


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (1,797 8x8 images, pixels 0..16, labels 0..9), read from the file
    scikit-learn ships, as its load_digits does, without importing scikit-learn: its imports
    (scipy.stats, ...) cost ~1 s of CPU in every worker and every command."""
    import importlib.util

    package = importlib.util.find_spec("sklearn").submodule_search_locations[0]
    data = np.loadtxt(Path(package) / "datasets" / "data" / "digits.csv.gz", delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


def synthetic(rows: int, features: int, classes: int, seed: int,
              task: str = "classification") -> tuple[np.ndarray, np.ndarray]:
    """Classification: Gaussian clusters around random centres, with label noise. Regression:
    a noisy nonlinear function of the features. Learnable, not trivial."""
    rng = np.random.default_rng([seed, 20_261_122])
    if task == "regression":
        x = rng.normal(0.0, 1.0, size=(rows, features)).astype(np.float32)
        w = rng.normal(0.0, 1.0, size=features).astype(np.float32)
        y = x @ w + 0.5 * np.sin(2 * x[:, 0]) + rng.normal(0.0, 0.3, size=rows)
        return x, y.astype(np.float32)
    centres = rng.normal(0.0, 1.5, size=(classes, features)).astype(np.float32)
    y = rng.integers(0, classes, size=rows)
    x = centres[y] + rng.normal(0.0, 1.0, size=(rows, features)).astype(np.float32)
    flip = rng.random(rows) < 0.05
    y[flip] = rng.integers(0, classes, size=int(flip.sum()))
    return x.astype(np.float32), y.astype(np.int64)


def split(x, y, test_fraction: float, seed: int, names, task: str = "classification") -> Dataset:
    order = np.random.default_rng([seed, 1]).permutation(len(y))
    n_test = max(1, int(round(len(y) * test_fraction)))
    test, train = order[:n_test], order[n_test:]
    if task == "regression":
        y, classes = np.asarray(y, dtype=np.float32), 0
    else:
        y = np.asarray(y, dtype=np.int64)
        classes = int(y.max()) + 1
    return Dataset(x[train], y[train], x[test], y[test], classes, tuple(names), task)


def _parquet_dataset(cfg: DataConfig, storage: StorageSpec | None, key: str = "data.path"):
    import pyarrow.dataset as pads

    from orchestrator.data.manifest import list_files

    spec = storage.sibling(cfg.path, key) if storage else StorageSpec(cfg.path, key=key)
    fs, path = spec.filesystem()
    try:  # the files a streamed run reads too: a glob's matches, a folder's *.parquet
        files = [info.path for info in list_files(fs, path, key)]
        return pads.dataset(files, filesystem=fs, format="parquet")
    except (FileNotFoundError, OSError, pa.ArrowInvalid) as exc:
        raise ConfigError(f"{key}={cfg.path!r}: no parquet data there ({one_line(exc)})") from exc


def check_parquet(cfg: DataConfig, storage: StorageSpec | None = None, key: str = "data.path"):
    """Check the schema only (cheap): the label exists and every feature is numeric.
    Returns the opened dataset, so a reader does not discover the files a second time."""
    dataset = _parquet_dataset(cfg, storage, key)
    schema = dataset.schema
    if cfg.label not in schema.names:
        raise ConfigError(
            f"data.label={cfg.label!r} is not a column of {cfg.path}: columns are "
            + ", ".join(schema.names)
        )
    check_numeric(schema, cfg.label, key, cfg.path, cfg.columns)
    check_same_schema(dataset, cfg, key)
    return dataset


# Files whose footers the driver reads up front to compare their columns: pyarrow reads a
# dataset with its first file's, so another file's missing column would come back as nulls (a
# "NaN" error, or NaN training) and an extra one would be dropped. Streamed data of more
# files has every footer read for its manifest anyway, which compares them there.
SCHEMA_CHECK_FILES = 256


def check_same_schema(dataset, cfg: DataConfig, key: str) -> None:
    fragments = dataset.get_fragments()
    first = next(fragments, None)
    if first is None:
        return
    for checked, fragment in enumerate(fragments, start=2):
        if checked > SCHEMA_CHECK_FILES:
            return
        try:
            schema = fragment.physical_schema  # its footer
        except (OSError, pa.ArrowInvalid) as exc:
            raise ConfigError(f"{key}={cfg.path!r}: {fragment.path} is not a readable parquet "
                              f"file ({one_line(exc)[:160]})") from None
        if not same_columns(schema, dataset.schema):
            raise ConfigError(
                f"{key}={cfg.path!r}: {fragment.path} has another schema than {first.path} "
                f"({schema_difference(dataset.schema, schema, cfg.label)}); "
                "every file must have the same columns and types")


def eval_config(cfg: DataConfig) -> DataConfig:
    """data.eval_path read like data.path (its errors name data.eval_path)."""
    return DataConfig(name="parquet", path=cfg.eval_path, label=cfg.label, task=cfg.task,
                      columns=cfg.columns)


def read_parquet(cfg: DataConfig, storage: StorageSpec | None, key: str = "data.path",
                 values: np.ndarray | None = None):
    """(x, y, feature names, task, label values) of cfg.path. Class ids number the sorted
    label values found there, or ``values`` (data.path's, for data.eval_path)."""
    dataset = check_parquet(cfg, storage, key)
    names = list(feature_columns(dataset.schema.names, cfg.label, cfg.columns, cfg.path))
    table = dataset.to_table(columns=[*names, cfg.label])
    x = np.column_stack([table[n].to_numpy(zero_copy_only=False) for n in names]).astype(np.float32)
    task = parquet_task(cfg, table.schema.field(cfg.label).type)
    labels = table[cfg.label].to_numpy(zero_copy_only=False)
    if task == "regression":
        return x, labels.astype(np.float32), names, task, None
    if values is None:
        values = np.unique(labels)
    elif not np.isin(labels, values).all():
        raise ConfigError(f"{key}={cfg.path!r}: label values that data.path does not have")
    y = np.searchsorted(values, labels)  # any label values -> 0..k-1
    return x, y.astype(np.int64), names, task, values
