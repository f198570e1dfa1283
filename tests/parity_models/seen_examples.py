"""A model whose forward pass in training counts the examples it sees in a non-trainable float variable
(as a running-normalization layer keeps its count), next to a plain dense layer.

Each push carries how its forward pass changed the count (the minibatch's examples). A PS that adds every
push's change ends with exactly the examples trained, however stale the pushes are; one that took each
push's value instead would lose the pushes computed from a count that another push has moved since.
"""

import sys
from pathlib import Path

import keras
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).parent))
from parity_data import (
    eval_metrics_fn,  # noqa: F401
    loss,  # noqa: F401
)
from parity_data import feed as _feed


@keras.saving.register_keras_serializable(package="parity")
class SeenExamples(keras.layers.Layer):
    """The identity; in training it adds the batch's size to ``seen``."""

    def build(self, input_shape):
        self.seen = self.add_weight(name="seen", shape=(), initializer="zeros", trainable=False)

    def call(self, inputs, training=False):
        if training:
            self.seen.assign_add(tf.cast(tf.shape(inputs)[0], self.seen.dtype))
        return inputs


def custom_model() -> keras.Model:
    x = keras.Input(shape=(4,), name="x")
    c = keras.Input(shape=(1,), name="c", dtype="int64")
    counted = SeenExamples(name="counter")(x)
    init = keras.initializers.GlorotUniform(seed=3)
    out = keras.layers.Dense(1, kernel_initializer=init, name="out")(counted)
    return keras.Model({"x": x, "c": c}, out)


def feed(dataset, mode, _metadata):
    return _feed(dataset, mode)


def optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.01)
