"""A small classifier of four float features, fed from any reader: serialized ``tf.train.Example`` records
(RecordIO, TFRecord) or a dict of columns (CSV, Parquet, SQL). Used by tests/test_readers_same_model.py."""

import keras
import tensorflow as tf

FEATURES = ("f0", "f1", "f2", "f3")
CLASSES = 3


def custom_model() -> keras.Model:
    keras.utils.set_random_seed(7)
    inputs = keras.Input(shape=(len(FEATURES),), name="features")
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    outputs = keras.layers.Dense(CLASSES)(hidden)
    return keras.Model(inputs, outputs)


def loss(labels, predictions):
    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.reshape(labels, [-1]), logits=predictions)
    )


def optimizer(lr: float = 0.05) -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(lr)


def _example(record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    spec = {name: tf.io.FixedLenFeature([], tf.float32) for name in FEATURES}
    spec["label"] = tf.io.FixedLenFeature([], tf.int64)
    parsed = tf.io.parse_single_example(record, spec)
    return tf.stack([parsed[name] for name in FEATURES]), parsed["label"]


def _row(row: dict) -> tuple[tf.Tensor, tf.Tensor]:
    features = tf.stack([tf.cast(row[name], tf.float32) for name in FEATURES])
    return features, tf.cast(row["label"], tf.int64)


def feed(dataset: tf.data.Dataset, mode: str, metadata=None) -> tf.data.Dataset:
    parsed = dataset.map(_row if isinstance(dataset.element_spec, dict) else _example)
    if mode == "prediction":
        return parsed.map(lambda features, label: features)
    return parsed


def eval_metrics_fn():
    return {
        "accuracy": lambda labels, predictions: tf.cast(
            tf.equal(tf.argmax(predictions, 1), tf.reshape(tf.cast(labels, tf.int64), [-1])), tf.float32
        )
    }
