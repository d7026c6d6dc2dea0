"""The bundled real dataset (scikit-learn's digits), a seeded synthetic one, and parquet.

Every worker loads the same arrays and the same train/test split (keyed by the seed);
which rows a worker trains on is decided by orchestrator.data.order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from orchestrator.config.schema import DataConfig
from orchestrator.errors import ConfigError
from orchestrator.storage import StorageSpec


@dataclass(frozen=True)
class Dataset:
    x_train: np.ndarray  # float32, (rows, features)
    y_train: np.ndarray  # int64 class ids
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    feature_names: tuple[str, ...]

    @property
    def num_features(self) -> int:
        return self.x_train.shape[1]


def load_dataset(cfg: DataConfig, seed: int, storage: StorageSpec | None = None) -> Dataset:
    if cfg.name == "digits":
        from sklearn.datasets import load_digits

        bunch = load_digits()
        x, y = bunch.data.astype(np.float32) / 16.0, bunch.target.astype(np.int64)
        names = tuple(f"pixel_{i}" for i in range(x.shape[1]))
    elif cfg.name == "synthetic":
        x, y = synthetic(cfg.rows, cfg.features, cfg.classes, seed)
        names = tuple(f"f{i}" for i in range(cfg.features))
    else:
        x, y, names = read_parquet(cfg, storage)
    return split(x, y, cfg.test_fraction, seed, names)


def synthetic(rows: int, features: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian clusters around random centres, with label noise: learnable, not trivial."""
    rng = np.random.default_rng([seed, 20_261_122])
    centres = rng.normal(0.0, 1.5, size=(classes, features)).astype(np.float32)
    y = rng.integers(0, classes, size=rows)
    x = centres[y] + rng.normal(0.0, 1.0, size=(rows, features)).astype(np.float32)
    flip = rng.random(rows) < 0.05
    y[flip] = rng.integers(0, classes, size=int(flip.sum()))
    return x.astype(np.float32), y.astype(np.int64)


def split(x, y, test_fraction: float, seed: int, names) -> Dataset:
    order = np.random.default_rng([seed, 1]).permutation(len(y))
    n_test = max(1, int(round(len(y) * test_fraction)))
    test, train = order[:n_test], order[n_test:]
    classes = int(y.max()) + 1
    return Dataset(x[train], y[train], x[test], y[test], classes, tuple(names))


def _parquet_dataset(cfg: DataConfig, storage: StorageSpec | None):
    import pyarrow.dataset as pads

    spec = storage.sibling(cfg.path) if storage else StorageSpec(cfg.path)
    fs, path = spec.filesystem()
    try:
        return pads.dataset(path, filesystem=fs, format="parquet")
    except (FileNotFoundError, OSError, pa.ArrowInvalid) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"data.path={cfg.path!r}: no parquet data there ({reason})") from exc


def check_parquet(cfg: DataConfig, storage: StorageSpec | None = None):
    """Check the schema only (cheap): the label exists and every feature is numeric.
    Returns the opened dataset, so a reader does not discover the files a second time."""
    dataset = _parquet_dataset(cfg, storage)
    schema = dataset.schema
    if cfg.label not in schema.names:
        raise ConfigError(
            f"data.label={cfg.label!r} is not a column of {cfg.path}: columns are "
            + ", ".join(schema.names)
        )
    for fld in schema:
        numeric = pa.types.is_integer(fld.type) or pa.types.is_floating(fld.type) or pa.types.is_boolean(fld.type)
        if fld.name != cfg.label and not numeric:
            raise ConfigError(
                f"data.path={cfg.path!r}: feature column {fld.name!r} is {fld.type}, "
                "only numeric feature columns are allowed"
            )
    return dataset


def read_parquet(cfg: DataConfig, storage: StorageSpec | None):
    table = check_parquet(cfg, storage).to_table()
    names = [n for n in table.column_names if n != cfg.label]
    x = np.column_stack([table[n].to_numpy(zero_copy_only=False) for n in names]).astype(np.float32)
    labels = table[cfg.label].to_numpy(zero_copy_only=False)
    _, y = np.unique(labels, return_inverse=True)  # any label values -> 0..k-1
    return x, y.astype(np.int64), names
