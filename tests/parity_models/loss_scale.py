"""Parity case: ``LossScaleOptimizer``'s dynamic scale skipping, halving and growing, as in ``fit``.

An ``OverflowProbe`` layer adds ``1e30 × (share of the batch's rows whose id is 0) × sin(probe)`` to the
model's losses: the gradient of its one weight is finite, but past float32's range once a loss scale above
about 3e8 multiplies it. The scale starts at 2**40, so the first minibatches that hold such rows overflow and
are skipped (halving the scale each time) until it is small enough; every 2 finite steps double it again
(``dynamic_growth_steps=2``), so the skips come back through training. The term leaves the predictions alone.
"""

import sys
from pathlib import Path

import keras
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).parent))
from parity_data import eval_metrics_fn, loss  # noqa: F401
from parity_data import feed as _feed


@keras.saving.register_keras_serializable(package="parity")
class OverflowProbe(keras.layers.Layer):
    """Passes ``x`` on; adds a loss whose gradient overflows under a large loss scale (module docstring)."""

    def build(self, input_shape):
        self.probe = self.add_weight(shape=(), initializer="zeros", name="probe")

    def call(self, inputs):
        x, ids = inputs
        marked = tf.reduce_mean(tf.cast(tf.equal(ids, 0), x.dtype))
        self.add_loss(marked * 1e30 * tf.sin(self.probe))
        return x


def custom_model() -> keras.Model:
    keras.utils.set_random_seed(5)
    x = keras.Input(shape=(4,), name="x")
    c = keras.Input(shape=(1,), name="c", dtype="int64")
    h = keras.layers.Dense(8, activation="tanh")(OverflowProbe()([x, c]))
    outputs = keras.layers.Dense(1)(h)
    return keras.Model({"x": x, "c": c}, outputs)


def feed(dataset, mode, _metadata):
    return _feed(dataset, mode)


def optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.05), initial_scale=2.0**40, dynamic_growth_steps=2
    )
