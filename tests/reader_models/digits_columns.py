"""The digits example model (examples/model_zoo/digits.py) fed from any reader: serialized
``tf.train.Example`` records as the example's own ``feed`` takes them, or rows of a table with the pixels
in columns ``p0``..``p63`` and ``label`` (tests/reader_data.py writes digits so)."""

import importlib.util
from pathlib import Path

import tensorflow as tf

_spec = importlib.util.spec_from_file_location(
    "digits_example", Path(__file__).resolve().parents[2] / "examples" / "model_zoo" / "digits.py"
)
digits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digits)

custom_model, loss, optimizer, eval_metrics_fn = (
    digits.custom_model,
    digits.loss,
    digits.optimizer,
    digits.eval_metrics_fn,
)
PIXELS = tuple(f"p{i}" for i in range(64))


def _row(row: dict, mode: str):
    image = tf.stack([tf.cast(row[name], tf.float32) for name in PIXELS]) / 16.0
    if mode == "prediction":
        return image
    return image, tf.reshape(tf.cast(row["label"], tf.int32), [1])


def feed(dataset: tf.data.Dataset, mode: str, metadata: object) -> tf.data.Dataset:
    if not isinstance(dataset.element_spec, dict):
        return digits.feed(dataset, mode, metadata)
    dataset = dataset.map(lambda row: _row(row, mode))
    return dataset.shuffle(buffer_size=512) if mode == "training" else dataset
