"""Models a user might bring, plugged in through trainer.model._target_ (not in the package)."""

from __future__ import annotations


class TinyTorchNet:
    """A factory returning a torch module: in_features -> width -> out_features."""

    def __new__(cls, in_features: int, out_features: int, width: int = 32):
        from torch import nn

        return nn.Sequential(nn.Linear(in_features, width), nn.Tanh(), nn.Linear(width, out_features))


def compiled_tiny_net(in_features: int, out_features: int, width: int = 32,
                      backend: str = "aot_eager"):
    """A user who compiles their model before the trainer wraps it (torch.compile's default
    backend, inductor, needs a C compiler and ~20 CPU-s a process: aot_eager traces the same
    graphs with torch.compile's graph capture and AOTAutograd, and runs them as they are)."""
    import torch

    return torch.compile(TinyTorchNet(in_features, out_features, width), backend=backend)


def tiny_keras_model(in_features: int, num_classes: int, width: int = 32):
    import tensorflow as tf

    import trainers.mwms  # noqa: F401  (tf-keras before tensorflow)

    return tf.keras.Sequential([
        tf.keras.Input(shape=(in_features,)),
        tf.keras.layers.Dense(width, activation="tanh"),
        tf.keras.layers.Dense(num_classes),
    ])
