"""Parity case: mixed precision, as Keras recommends it: layers compute in float16 with float32 variables
(``dtype="mixed_float16"``), the output layer in float32, and ``LossScaleOptimizer``'s dynamic loss scale.
The policy is set per layer, so the process's global policy stays float32."""

import sys
from pathlib import Path

import keras

sys.path.insert(0, str(Path(__file__).parent))
from parity_data import eval_metrics_fn, loss  # noqa: F401
from parity_data import feed as _feed


def custom_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    x = keras.Input(shape=(4,), name="x")
    c = keras.Input(shape=(1,), name="c", dtype="int64")
    h = keras.layers.Dense(16, activation="tanh", dtype="mixed_float16")(x)
    h = keras.layers.Dense(8, activation="relu", dtype="mixed_float16")(h)
    outputs = keras.layers.Dense(1, dtype="float32")(h)
    return keras.Model({"x": x, "c": c}, outputs)


def feed(dataset, mode, _metadata):
    return _feed(dataset, mode)


def optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05))
