"""The rows every parity model trains on, and what the model files share (``feed``, ``loss``, metrics).

A record holds ``x`` (4 floats), ``c`` (an id in [0, 20), for embeddings), ``y`` (a float target) and
``w`` (a sample weight). Rows are drawn from a fixed seed, so the job and ``model.fit`` see the same rows.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from edl_argo.data.examples import encode_example
from edl_argo.model import Mode

VOCABULARY = 20


def records(count: int) -> list[bytes]:
    """``count`` serialized rows (the same for every call with the same count)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(count, 4)).astype(np.float32)
    c = rng.integers(0, VOCABULARY, size=count)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.1 * c + rng.normal(scale=0.1, size=count)).astype(np.float32)
    w = rng.uniform(0.2, 2.0, size=count).astype(np.float32)
    return [
        encode_example({"x": x[i], "c": int(c[i]), "y": float(y[i]), "w": float(w[i])}) for i in range(count)
    ]


_SPEC = {
    "x": tf.io.FixedLenFeature([4], tf.float32),
    "c": tf.io.FixedLenFeature([1], tf.int64),
    "y": tf.io.FixedLenFeature([1], tf.float32),
    "w": tf.io.FixedLenFeature([], tf.float32),
}


def feed(dataset: tf.data.Dataset, mode: str, weighted: bool = False) -> tf.data.Dataset:
    """``{"x", "c"}`` features, ``y`` labels and, when ``weighted`` and training, ``w`` sample weights."""

    def parse(record: tf.Tensor):
        row = tf.io.parse_single_example(record, _SPEC)
        features = {"x": row["x"], "c": row["c"]}
        if mode == Mode.PREDICTION:
            return features
        if weighted and mode == Mode.TRAINING:
            return features, row["y"], row["w"]
        return features, row["y"]

    return dataset.map(parse)


def loss(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
    """Mean squared error, a scalar."""
    return tf.reduce_mean(tf.square(tf.cast(labels, predictions.dtype) - predictions))


def eval_metrics_fn() -> dict:
    return {"squared_error": lambda labels, predictions: tf.square(labels - predictions)}
