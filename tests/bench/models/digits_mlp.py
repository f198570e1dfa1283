"""The benchmarks' digits MLP: 64 → Dense64 → Dense10 (4.8 k params), on scikit-learn's 8×8 digits.

Follows ElasticDL's model-zoo contract (``custom_model``, ``feed``, ``loss``, ``optimizer``,
``eval_metrics_fn``), like ``examples/model_zoo/digits.py``, and reads the same records
(:func:`edl_argo.data.commands.digits_records`): ``image`` (64 floats, 0–16) and ``label`` (int64).
"""

import tensorflow as tf

from edl_argo.model import Mode


def custom_model() -> tf.keras.Model:
    inputs = tf.keras.Input(shape=(64,), name="image")
    x = tf.keras.layers.Dense(64, activation="relu")(inputs)
    outputs = tf.keras.layers.Dense(10, name="logits")(x)
    return tf.keras.Model(inputs=inputs, outputs=outputs, name="digits_mlp")


_FEATURES = {"image": tf.io.FixedLenFeature([64], tf.float32)}
_LABEL = {"label": tf.io.FixedLenFeature([1], tf.int64)}


def feed(dataset: tf.data.Dataset, mode: str, _metadata: object) -> tf.data.Dataset:
    def parse(record: tf.Tensor):
        spec = _FEATURES if mode == Mode.PREDICTION else {**_FEATURES, **_LABEL}
        parsed = tf.io.parse_single_example(record, spec)
        image = parsed["image"] / 16.0
        if mode == Mode.PREDICTION:
            return image
        return image, tf.cast(parsed["label"], tf.int32)

    return dataset.map(parse)


def loss(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
    labels = tf.reshape(labels, [-1])
    return tf.reduce_mean(
        tf.keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True)
    )


def optimizer(lr: float = 0.05) -> tf.keras.optimizers.Optimizer:
    return tf.keras.optimizers.SGD(learning_rate=lr, momentum=0.9)


def eval_metrics_fn() -> dict:
    return {
        "accuracy": lambda labels, predictions: tf.equal(
            tf.argmax(predictions, 1, output_type=tf.int32), tf.cast(tf.reshape(labels, [-1]), tf.int32)
        )
    }
