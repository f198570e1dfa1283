"""Parity case: a ``feed`` that yields ``(features, labels, sample_weights)``, trained with
``--grads-to-wait 2`` (pushes of unequal sizes averaged by examples)."""

import sys
from pathlib import Path

import keras

sys.path.insert(0, str(Path(__file__).parent))
from parity_data import eval_metrics_fn  # noqa: F401
from parity_data import feed as _feed


def custom_model() -> keras.Model:
    keras.utils.set_random_seed(5)
    x = keras.Input(shape=(4,), name="x")
    c = keras.Input(shape=(1,), name="c", dtype="int64")
    h = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras.layers.Dense(1)(h)
    return keras.Model({"x": x, "c": c}, outputs)


def feed(dataset, mode, _metadata):
    return _feed(dataset, mode, weighted=True)


def loss(labels, predictions):
    """Squared error per example: ``fit`` (and the job) weight it by the sample weights and average."""
    return keras.ops.mean(keras.ops.square(labels - predictions), axis=-1)


def optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.02, momentum=0.9)
