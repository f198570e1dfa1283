"""Parity case over 2 PS: an embedding table and dense layers clipped by one global norm, with dynamic
loss scaling (LossScaleOptimizer); the table is held non-negative (some of its entries would go below 0).

The table's initializer is a constant: a PS creates rows lazily with its own random draws, so random initial
rows could not match ``model.fit``'s (a difference by design, see the README).
"""

import sys
from pathlib import Path

import keras

sys.path.insert(0, str(Path(__file__).parent))
from parity_data import VOCABULARY, eval_metrics_fn, loss  # noqa: F401
from parity_data import feed as _feed


def custom_model() -> keras.Model:
    keras.utils.set_random_seed(11)
    x = keras.Input(shape=(4,), name="x")
    c = keras.Input(shape=(1,), name="c", dtype="int64")
    e = keras.layers.Embedding(
        VOCABULARY,
        3,
        embeddings_initializer=keras.initializers.Constant(0.02),
        embeddings_constraint=keras.constraints.NonNeg(),
    )(c)
    h = keras.layers.Concatenate()([x, keras.layers.Flatten()(e)])
    h = keras.layers.Dense(8, activation="tanh")(h)
    h = keras.layers.Dense(6, activation="tanh")(h)
    outputs = keras.layers.Dense(1)(h)
    return keras.Model({"x": x, "c": c}, outputs)


def feed(dataset, mode, _metadata):
    return _feed(dataset, mode)


def optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05, global_clipnorm=1.0))
