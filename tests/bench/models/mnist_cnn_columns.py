"""The benchmarks' MNIST-style CNN (``mnist_cnn.py``) fed from a table: one column per pixel (``p0`` ..
``p783``) and ``label`` (tests/reader_data.py writes the records so), or from serialized examples as
``mnist_cnn.py`` itself. The columns are stacked per batch of rows, not per row: 784 scalar ops per record
would cost more than the read being measured."""

import importlib.util
from pathlib import Path

import tensorflow as tf

_spec = importlib.util.spec_from_file_location("mnist_cnn", Path(__file__).with_name("mnist_cnn.py"))
mnist_cnn = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mnist_cnn)

custom_model, loss, optimizer, eval_metrics_fn = (
    mnist_cnn.custom_model,
    mnist_cnn.loss,
    mnist_cnn.optimizer,
    mnist_cnn.eval_metrics_fn,
)
PIXELS = tuple(f"p{i}" for i in range(mnist_cnn.IMAGE_SIDE * mnist_cnn.IMAGE_SIDE))
STACK_ROWS = 256


def feed(dataset: tf.data.Dataset, mode: str, metadata: object) -> tf.data.Dataset:
    if not isinstance(dataset.element_spec, dict):
        return mnist_cnn.feed(dataset, mode, metadata)

    def stacked(rows: dict):
        image = tf.stack([tf.cast(rows[name], tf.float32) for name in PIXELS], axis=1)
        if mode == "prediction":
            return image
        return image, tf.reshape(tf.cast(rows["label"], tf.int32), [-1, 1])

    dataset = dataset.batch(STACK_ROWS).map(stacked).unbatch()
    return dataset.shuffle(buffer_size=512) if mode == "training" else dataset
