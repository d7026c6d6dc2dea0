"""Default Keras models for the MWMS trainer (logits out)."""

from __future__ import annotations

import tensorflow as tf

import trainers.mwms  # noqa: F401  (tf-keras before tensorflow)


def mlp(in_features: int, num_classes: int, hidden=(128, 64)) -> tf.keras.Model:
    layers = [tf.keras.Input(shape=(in_features,))]
    layers += [tf.keras.layers.Dense(h, activation="relu") for h in hidden]
    layers.append(tf.keras.layers.Dense(num_classes))
    return tf.keras.Sequential(layers)
