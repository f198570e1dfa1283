"""The benchmarks' big dense MLP: 64 → Dense4096 → Dense4096 → Dense2048 → Dense10 (25.4 M params, ResNet-50's
size), Adam, on scikit-learn's 8×8 digits.

A dense model whose step is dominated by moving its parameters: each minibatch's gradients (about 100 MB)
go to the PS and the new parameters come back. Follows ElasticDL's model-zoo contract and takes the
records, ``feed`` and metric from ``examples/model_zoo/digits.py``.
"""

import importlib.util
from pathlib import Path

import tensorflow as tf

_ZOO_FILE = Path(__file__).resolve().parents[3] / "examples" / "model_zoo" / "digits.py"
_spec = importlib.util.spec_from_file_location("bench_zoo_digits_big", _ZOO_FILE)
assert _spec is not None and _spec.loader is not None
zoo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(zoo)

loss = zoo.loss
eval_metrics_fn = zoo.eval_metrics_fn


def custom_model() -> tf.keras.Model:
    inputs = tf.keras.Input(shape=(64,), name="image")
    x = tf.keras.layers.Dense(4096, activation="relu")(inputs)
    x = tf.keras.layers.Dense(4096, activation="relu")(x)
    x = tf.keras.layers.Dense(2048, activation="relu")(x)
    outputs = tf.keras.layers.Dense(10, name="logits")(x)
    return tf.keras.Model(inputs=inputs, outputs=outputs, name="big_mlp")


def optimizer() -> tf.keras.optimizers.Optimizer:
    return tf.keras.optimizers.Adam(learning_rate=1e-4)


def feed(dataset: tf.data.Dataset, mode: str, _metadata: object) -> tf.data.Dataset:
    return dataset.map(lambda record: zoo.parse(record, mode))
