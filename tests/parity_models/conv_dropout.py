"""Parity case: the shape of ElasticDL's model-zoo MNIST model (convolutions, BatchNormalization, max pooling,
Dropout, a dense classifier), on scikit-learn's 8×8 digits.

``keras.utils.set_random_seed`` fixes the initial weights and the seed Dropout's generator starts from, so the
job's worker draws the same masks as ``fit``, step for step.
"""

import keras
import tensorflow as tf

from edl_argo.data.commands import digits_records
from edl_argo.model import Mode


def records(count: int) -> list[bytes]:
    """The first ``count`` training records of ``edl-argo data digits`` (``image``: 64 floats, ``label``)."""
    return digits_records(test_fraction=0.2, seed=0)[0][:count]


def custom_model() -> keras.Model:
    keras.utils.set_random_seed(7)
    inputs = keras.Input(shape=(64,), name="image")
    x = keras.layers.Reshape((8, 8, 1))(inputs)
    x = keras.layers.Conv2D(8, 3, activation="relu")(x)
    x = keras.layers.Conv2D(16, 3, activation="relu")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Dropout(0.25)(x)
    x = keras.layers.Flatten()(x)
    outputs = keras.layers.Dense(10)(x)
    return keras.Model(inputs, outputs)


_SPEC = {"image": tf.io.FixedLenFeature([64], tf.float32), "label": tf.io.FixedLenFeature([1], tf.int64)}


def feed(dataset: tf.data.Dataset, mode: str, _metadata: object) -> tf.data.Dataset:
    def parse(record: tf.Tensor):
        row = tf.io.parse_single_example(record, _SPEC)
        image = row["image"] / 16.0
        return image if mode == Mode.PREDICTION else (image, row["label"])

    return dataset.map(parse)


def loss(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
    labels = tf.cast(tf.reshape(labels, [-1]), tf.int32)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=predictions))


def optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.05)


def eval_metrics_fn() -> dict:
    return {
        "accuracy": lambda labels, predictions: tf.equal(
            tf.argmax(predictions, 1, output_type=tf.int32), tf.cast(tf.reshape(labels, [-1]), tf.int32)
        )
    }
