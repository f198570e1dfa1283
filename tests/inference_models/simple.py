"""TEST FIXTURE: one input tensor ``x`` (4 floats), label ``y`` (0-2); one factory per kind of Keras model.

``--model-def tests/inference_models/simple.py:<factory>`` with ``functional``, ``sequential``,
``subclassed`` or ``lambda_model``.
"""

import keras
import tensorflow as tf

from edl_argo.model import Mode


def functional() -> keras.Model:
    inputs = keras.Input(shape=(4,), name="x")
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(hidden))


def sequential() -> keras.Model:
    return keras.Sequential(
        [keras.Input(shape=(4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]
    )


class Subclassed(keras.Model):
    """A model only its own class can build: loading ``model.keras`` without this file fails."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.logits = keras.layers.Dense(3)

    def call(self, inputs: tf.Tensor) -> tf.Tensor:
        return self.logits(self.hidden(inputs) * 0.5)


def subclassed() -> keras.Model:
    return Subclassed()


def lambda_model() -> keras.Model:
    inputs = keras.Input(shape=(4,), name="x")
    doubled = keras.layers.Lambda(lambda t: t * 2.0 - 1.0)(inputs)
    return keras.Model(inputs, keras.layers.Dense(3)(doubled))


def feed(dataset: tf.data.Dataset, mode: str, _metadata: object) -> tf.data.Dataset:
    spec = {"x": tf.io.FixedLenFeature([4], tf.float32)}
    if mode != Mode.PREDICTION:
        spec["y"] = tf.io.FixedLenFeature([1], tf.int64)

    def parse(record: tf.Tensor):
        parsed = tf.io.parse_single_example(record, spec)
        return parsed["x"] if mode == Mode.PREDICTION else (parsed["x"], parsed["y"])

    return dataset.map(parse)


def loss(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(
        keras.losses.sparse_categorical_crossentropy(tf.reshape(labels, [-1]), predictions, from_logits=True)
    )


def optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.1)


def batch_mean_first_logit(_labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
    """One value per minibatch (a mean): the evaluation must weight it by the minibatch's records."""
    return tf.reduce_mean(outputs[:, 0])


def eval_metrics_fn() -> dict:
    return {
        "accuracy": keras.metrics.SparseCategoricalAccuracy(),
        "batch_mean_first_logit": batch_mean_first_logit,
    }
