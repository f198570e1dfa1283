"""The benchmarks' digits MLP: 64 → Dense64 → Dense10 (4.8 k params), on scikit-learn's 8×8 digits.

Follows ElasticDL's model-zoo contract (``custom_model``, ``feed``, ``loss``, ``optimizer``,
``eval_metrics_fn``) and takes everything but the model from ``examples/model_zoo/digits.py`` (same records,
loss, optimizer and metric); its ``feed`` does not shuffle, so the job reads what ``model.fit`` reads.
"""

import importlib.util
from pathlib import Path

import tensorflow as tf

_ZOO_FILE = Path(__file__).resolve().parents[3] / "examples" / "model_zoo" / "digits.py"
_spec = importlib.util.spec_from_file_location("bench_zoo_digits", _ZOO_FILE)
assert _spec is not None and _spec.loader is not None
zoo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(zoo)

loss = zoo.loss
optimizer = zoo.optimizer
eval_metrics_fn = zoo.eval_metrics_fn


def custom_model() -> tf.keras.Model:
    inputs = tf.keras.Input(shape=(64,), name="image")
    x = tf.keras.layers.Dense(64, activation="relu")(inputs)
    outputs = tf.keras.layers.Dense(10, name="logits")(x)
    return tf.keras.Model(inputs=inputs, outputs=outputs, name="digits_mlp")


def feed(dataset: tf.data.Dataset, mode: str, _metadata: object) -> tf.data.Dataset:
    return dataset.map(lambda record: zoo.parse(record, mode))
