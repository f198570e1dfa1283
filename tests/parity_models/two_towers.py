"""Parity case with several workers: two independent towers on the same inputs, trained on one loss.

* ``plain``: ``Dense(8, relu, L2 regularizer)`` → ``Dense(1)``: no state, so a step over the minibatches of
  several workers (their gradients averaged by examples) is one step over their concatenation: equal to it.
* ``norm``: ``BatchNormalization`` (momentum 0.5, so that its statistics move) of the inputs → ``Dense(1)``:
  each minibatch is normalized with its own statistics, and each worker's moving statistics are averaged, so
  with several workers it differs from one step over the concatenation by design.

The outputs are ``[plain, norm]``; the loss is the sum of both towers' mean squared errors, and the
optimizer (Adam) acts on each variable alone, so the ``norm`` tower does not reach the ``plain`` tower's
updates: one job shows both the equality and the measured difference.
"""

import sys
from pathlib import Path

import keras
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).parent))
from parity_data import eval_metrics_fn  # noqa: F401
from parity_data import feed as _feed


def custom_model() -> keras.Model:
    x = keras.Input(shape=(4,), name="x")
    c = keras.Input(shape=(1,), name="c", dtype="int64")
    init = keras.initializers.GlorotUniform
    hidden = keras.layers.Dense(
        8,
        activation="relu",
        kernel_initializer=init(seed=3),
        kernel_regularizer=keras.regularizers.L2(1e-2),
        name="plain_hidden",
    )(x)
    plain = keras.layers.Dense(1, kernel_initializer=init(seed=4), name="plain_out")(hidden)
    normalized = keras.layers.BatchNormalization(momentum=0.5, name="norm")(x)
    norm = keras.layers.Dense(1, kernel_initializer=init(seed=5), name="norm_out")(normalized)
    outputs = keras.layers.Concatenate(name="towers")([plain, norm])
    return keras.Model({"x": x, "c": c}, outputs)


def feed(dataset, mode, _metadata):
    return _feed(dataset, mode)


def loss(labels, predictions):
    """Each tower's mean squared error, summed (a scalar)."""
    labels = tf.cast(labels, predictions.dtype)
    return tf.reduce_mean(tf.square(labels - predictions[:, :1])) + tf.reduce_mean(
        tf.square(labels - predictions[:, 1:])
    )


def optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.05, 10, 0.9))
