"""``python -m trainers.tf_ps.model_trial '{"model": ..., "features": F, "outputs": O}'``:
build the model and run it on two rows; one JSON line out, {"problem": the refusal or null}
(trainers/tf_ps/config.py runs it before Ray starts)."""

from __future__ import annotations

import json
import sys

import trainers.tf_ps  # noqa: F401  (tf-keras before tensorflow)
from orchestrator.errors import one_line
from trainers.neural import not_tf_keras


def problem(model: dict, features: int, outputs: int) -> str | None:
    import tensorflow as tf
    from hydra.utils import instantiate

    target = model["_target_"]
    try:
        built = instantiate(dict(model), in_features=features, num_classes=outputs,
                            _convert_="all")
    except Exception as exc:
        return (f"trainer.model._target_={target!r} did not build: {type(exc).__name__}: "
                f"{one_line(exc)[:300]}")
    if not isinstance(built, tf.keras.Model):
        return not_tf_keras(target, built)
    try:
        out = built(tf.zeros((2, features)), training=False)
    except Exception as exc:
        return (f"trainer.model._target_={target!r} fails on a batch of {features} features: "
                f"{type(exc).__name__}: {one_line(exc)[:300]}")
    if tuple(out.shape) != (2, outputs):
        return (f"trainer.model._target_={target!r} gives outputs of shape {tuple(out.shape)[1:]}"
                f" for {features} features; the data wants ({outputs},)")
    return None


if __name__ == "__main__":
    asked = json.loads(sys.argv[1])
    print(json.dumps({"problem": problem(asked["model"], int(asked["features"]),
                                         int(asked["outputs"]))}))
