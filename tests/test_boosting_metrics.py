"""A share's held-out metrics added over the ranks (trainers/boosting.py metric_sums) are the
metrics of all the rows at once."""

from __future__ import annotations

import numpy as np
import pytest

from trainers.boosting import metric_sums, metrics_from_sums
from trainers.boosting import test_metrics as metrics_of_all_rows


@pytest.mark.parametrize("classes", [0, 2, 3])
def test_metrics_summed_over_ranks_are_the_metrics_of_all_rows(classes):
    rng = np.random.default_rng(classes)
    n = 3000
    if classes == 0:
        y = rng.normal(size=n)
        prediction = y + rng.normal(scale=0.5, size=n)
    else:
        y = rng.integers(0, classes, size=n)
        logits = rng.normal(size=(n, classes)) + 1.5 * np.eye(classes)[y]
        prediction = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        if classes == 2:
            prediction = prediction[:, 1]
    whole = metrics_of_all_rows(prediction, y, classes)
    parts = [slice(0, 1000), slice(1000, 1700), slice(1700, n)]  # three ranks' shares
    summed = metrics_from_sums(sum(metric_sums(prediction[p], y[p], classes) for p in parts),
                               classes)
    assert set(summed) == set(whole)
    for name, value in whole.items():
        tolerance = 1e-3 if name == "test_auc" else 1e-9  # AUC from 4096-bin histograms
        assert summed[name] == pytest.approx(value, abs=tolerance), name
