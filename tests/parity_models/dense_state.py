"""Parity case: a dense regression model with the state and optimizer features of everyday Keras.

BatchNormalization (non-trainable moving statistics), a NonNeg kernel constraint, an L2 kernel
regularizer, a weight no loss reaches (a layer's unused weight: no gradient), and AdamW with a
learning-rate schedule, weight decay, EMA and a static loss scale.
"""

import sys
from pathlib import Path

import keras

sys.path.insert(0, str(Path(__file__).parent))
from parity_data import eval_metrics_fn, loss  # noqa: F401
from parity_data import feed as _feed


@keras.saving.register_keras_serializable(package="parity")
class Spare(keras.layers.Layer):
    """Passes its inputs on; holds a weight nothing uses yet (its gradient is None)."""

    def build(self, input_shape):
        self.spare = self.add_weight(shape=(3,), initializer="ones", name="spare")

    def call(self, inputs):
        return inputs


def custom_model() -> keras.Model:
    keras.utils.set_random_seed(7)
    x = keras.Input(shape=(4,), name="x")
    c = keras.Input(shape=(1,), name="c", dtype="int64")
    h = keras.layers.Dense(
        8,
        activation="relu",
        kernel_constraint=keras.constraints.NonNeg(),
        kernel_regularizer=keras.regularizers.L2(1e-3),
    )(Spare()(x))
    h = keras.layers.BatchNormalization()(h)
    outputs = keras.layers.Dense(1)(h)
    return keras.Model({"x": x, "c": c}, outputs)


def feed(dataset, mode, _metadata):
    return _feed(dataset, mode)


def optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.AdamW(
        learning_rate=keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=10, decay_rate=0.8),
        weight_decay=0.05,
        use_ema=True,
        loss_scale_factor=64.0,
    )
