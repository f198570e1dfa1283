"""TEST FIXTURE: two outputs, ``cls`` (3 logits) and ``reg`` (1 value), labels ``{"cls": y, "reg": z}``.

``--model-def tests/inference_models/multi_output.py:<factory>`` with ``list_output`` (a functional model
returning ``[cls, reg]``) or ``dict_output`` (a subclassed model returning ``{"cls": ..., "reg": ...}``).
"""

import keras
import tensorflow as tf

from edl_argo.model import Mode


def list_output() -> keras.Model:
    inputs = keras.Input(shape=(4,), name="x")
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    return keras.Model(
        inputs, [keras.layers.Dense(3, name="cls")(hidden), keras.layers.Dense(1, name="reg")(hidden)]
    )


class DictOutput(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.cls = keras.layers.Dense(3)
        self.reg = keras.layers.Dense(1)

    def call(self, inputs: tf.Tensor) -> dict:
        hidden = self.hidden(inputs)
        return {"cls": self.cls(hidden), "reg": self.reg(hidden)}


def dict_output() -> keras.Model:
    return DictOutput()


def feed(dataset: tf.data.Dataset, mode: str, _metadata: object) -> tf.data.Dataset:
    spec = {"x": tf.io.FixedLenFeature([4], tf.float32)}
    if mode != Mode.PREDICTION:
        spec["y"] = tf.io.FixedLenFeature([1], tf.int64)
        spec["z"] = tf.io.FixedLenFeature([1], tf.float32)

    def parse(record: tf.Tensor):
        parsed = tf.io.parse_single_example(record, spec)
        if mode == Mode.PREDICTION:
            return parsed["x"]
        return parsed["x"], {"cls": parsed["y"], "reg": parsed["z"]}

    return dataset.map(parse)


def _named(predictions):
    if isinstance(predictions, dict):
        return predictions
    return dict(zip(("cls", "reg"), predictions, strict=True))


def loss(labels: dict, predictions) -> tf.Tensor:
    outputs = _named(predictions)
    cls = keras.losses.sparse_categorical_crossentropy(
        tf.reshape(labels["cls"], [-1]), outputs["cls"], from_logits=True
    )
    return tf.reduce_mean(cls) + tf.reduce_mean(tf.square(labels["reg"] - outputs["reg"]))


def optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.05)


def squared_error(labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
    return tf.reshape(tf.square(tf.cast(labels, tf.float32) - outputs), [-1])


def eval_metrics_fn() -> dict:
    return {"cls": {"accuracy": keras.metrics.SparseCategoricalAccuracy()}, "reg": {"mse": squared_error}}
