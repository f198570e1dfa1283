"""The benchmarks' 28×28 MNIST-style CNN: Conv32 → Conv64 → MaxPool → Dense128 → Dense10 (≈ 1.2 M params).

Follows ElasticDL's model-zoo contract (``custom_model``, ``feed``, ``loss``, ``optimizer``,
``eval_metrics_fn``), like ``examples/model_zoo/digits.py``. Records are ``tf.train.Example`` with
``image`` (784 floats in [0, 1], row-major 28×28) and ``label`` (int64, 0–9); the benchmarks generate them
(:func:`tests.bench.data.mnist_like_records`).
"""

import tensorflow as tf

from edl_argo.model import Mode

IMAGE_SIDE = 28
NUM_CLASSES = 10


def custom_model() -> tf.keras.Model:
    inputs = tf.keras.Input(shape=(IMAGE_SIDE * IMAGE_SIDE,), name="image")
    x = tf.keras.layers.Reshape((IMAGE_SIDE, IMAGE_SIDE, 1))(inputs)
    x = tf.keras.layers.Conv2D(32, 3, activation="relu")(x)
    x = tf.keras.layers.Conv2D(64, 3, activation="relu")(x)
    x = tf.keras.layers.MaxPooling2D()(x)
    x = tf.keras.layers.Flatten()(x)
    x = tf.keras.layers.Dense(128, activation="relu")(x)
    outputs = tf.keras.layers.Dense(NUM_CLASSES, name="logits")(x)
    return tf.keras.Model(inputs=inputs, outputs=outputs, name="mnist_cnn")


_FEATURES = {"image": tf.io.FixedLenFeature([IMAGE_SIDE * IMAGE_SIDE], tf.float32)}
_LABEL = {"label": tf.io.FixedLenFeature([1], tf.int64)}


def feed(dataset: tf.data.Dataset, mode: str, _metadata: object) -> tf.data.Dataset:
    def parse(record: tf.Tensor):
        spec = _FEATURES if mode == Mode.PREDICTION else {**_FEATURES, **_LABEL}
        parsed = tf.io.parse_single_example(record, spec)
        if mode == Mode.PREDICTION:
            return parsed["image"]
        return parsed["image"], tf.cast(parsed["label"], tf.int32)

    dataset = dataset.map(parse)
    if mode == Mode.TRAINING:
        dataset = dataset.shuffle(buffer_size=512)
    return dataset


def loss(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
    labels = tf.reshape(labels, [-1])
    return tf.reduce_mean(
        tf.keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True)
    )


def optimizer(lr: float = 0.001) -> tf.keras.optimizers.Optimizer:
    return tf.keras.optimizers.Adam(learning_rate=lr)


def eval_metrics_fn() -> dict:
    return {
        "accuracy": lambda labels, predictions: tf.equal(
            tf.argmax(predictions, 1, output_type=tf.int32), tf.cast(tf.reshape(labels, [-1]), tf.int32)
        )
    }
