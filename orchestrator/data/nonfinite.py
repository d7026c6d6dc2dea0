"""Missing, NaN and infinite values in parquet data, counted on the driver before anything
starts: a neural network trains to NaN on them, then reports a NaN metric as a success.

Counted in one read of the columns, for data small enough to read in a moment on the driver
(MAX_VALUES); larger data is left to the trainers (the PyTorch trainer stops at the step of a
NaN loss). XGBoost and LightGBM take NaN as a missing value: data.allow_nonfinite=true."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from orchestrator.config.schema import DataConfig
from orchestrator.data.manifest import feature_columns
from orchestrator.errors import ConfigError, one_line

MAX_VALUES = 10_000_000  # ~80 MB of doubles: well under a second from a local disk


def count_nonfinite(column: pa.Array | pa.ChunkedArray) -> int:
    """Nulls (a NaN written from pandas is a null), plus NaN and +-inf in a float column."""
    bad = column.null_count
    if pa.types.is_floating(column.type):
        bad += pc.sum(pc.invert(pc.is_finite(column))).as_py() or 0  # nulls are not summed
    return bad


def nonfinite_counts(dataset, columns: list[str]) -> dict[str, int] | None:
    """{column: count} of the columns that have any; None when the data is too large to read
    here. ``dataset``: a pyarrow dataset."""
    if dataset.count_rows() * len(columns) > MAX_VALUES:  # from the files' metadata
        return None
    counts = dict.fromkeys(columns, 0)
    for batch in dataset.to_batches(columns=columns):
        for name, column in zip(columns, batch.columns, strict=True):
            counts[name] += count_nonfinite(column)
    return {name: n for name, n in counts.items() if n}


def check_finite(cfg: DataConfig, dataset) -> None:
    """One line naming data.path, how many values and where, unless data.allow_nonfinite."""
    # data.allow_nonfinite is for features (boosters take them as missing values): a label
    # without a value is none, whatever it says.
    features = [] if cfg.allow_nonfinite else \
        feature_columns(dataset.schema.names, cfg.label, cfg.columns, cfg.path)
    try:
        counts = nonfinite_counts(dataset, [*features, cfg.label])
    except (OSError, pa.ArrowInvalid) as exc:  # a file past those whose footers were checked
        raise ConfigError(f"data.path={cfg.path!r}: cannot be read ({one_line(exc)[:200]})") \
            from None
    if not counts:
        return
    if cfg.label in counts and (cfg.allow_nonfinite or len(counts) == 1):
        raise ConfigError(
            f"data.label={cfg.label!r}: {counts[cfg.label]} rows of data.path={cfg.path!r} have "
            "a missing, NaN or infinite label: a row without a target trains nothing (data."
            "allow_nonfinite is for features): drop those rows")
    worst = sorted(counts.items(), key=lambda kv: -kv[1])
    where = ", ".join(f"{n} in {name!r}" for name, n in worst[:3])
    more = len(worst) - 3
    where += f" and {more} more column{'s' if more > 1 else ''}" if more > 0 else ""
    raise ConfigError(
        f"data.path={cfg.path!r}: {sum(counts.values())} missing, NaN or infinite values "
        f"({where}), on which a neural network trains to NaN: clean the data, or set "
        "data.allow_nonfinite=true (XGBoost and LightGBM take them as missing values)")
