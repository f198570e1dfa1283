"""TEST FIXTURE: ``feed`` returns a dict of two features (``a``: 3 floats, ``b``: 1 float), label ``y``."""

import keras
import tensorflow as tf

from edl_argo.model import Mode


def custom_model() -> keras.Model:
    a = keras.Input(shape=(3,), name="a")
    b = keras.Input(shape=(1,), name="b")
    joined = keras.layers.Concatenate()([a, keras.layers.Dense(2)(b)])
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(3)(joined))


def feed(dataset: tf.data.Dataset, mode: str, _metadata: object) -> tf.data.Dataset:
    spec = {"x": tf.io.FixedLenFeature([4], tf.float32)}
    if mode != Mode.PREDICTION:
        spec["y"] = tf.io.FixedLenFeature([1], tf.int64)

    def parse(record: tf.Tensor):
        parsed = tf.io.parse_single_example(record, spec)
        features = {"a": parsed["x"][:3], "b": parsed["x"][3:]}
        return features if mode == Mode.PREDICTION else (features, parsed["y"])

    return dataset.map(parse)


def loss(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(
        keras.losses.sparse_categorical_crossentropy(tf.reshape(labels, [-1]), predictions, from_logits=True)
    )


def optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.1)


def eval_metrics_fn() -> dict:
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy()}
