"""A wide-embedding click-through-rate model on generated categorical data (``edl-argo data ctr``).

26 categorical features, each with its own 100,000 × 16 embedding table (the tables live on the
parameter servers; workers pull only the rows a batch uses), concatenated into Dense(64) → sigmoid.
Records are ``tf.train.Example`` with ``ids`` (26 int64) and ``label`` (0 or 1).
"""

import tensorflow as tf

from edl_argo.model import Mode

NUM_FEATURES = 26
VOCABULARY = 100_000
EMBEDDING_DIM = 16


def custom_model() -> tf.keras.Model:
    ids = tf.keras.Input(shape=(NUM_FEATURES,), dtype="int64", name="ids")
    columns = [
        tf.keras.layers.Embedding(VOCABULARY, EMBEDDING_DIM, name=f"embedding_c{i}")(ids[:, i])
        for i in range(NUM_FEATURES)
    ]
    hidden = tf.keras.layers.Dense(64, activation="relu")(tf.keras.layers.Concatenate()(columns))
    outputs = tf.keras.layers.Dense(1, activation="sigmoid", name="probability")(hidden)
    return tf.keras.Model(inputs=ids, outputs=outputs, name="ctr")


_FEATURES = {"ids": tf.io.FixedLenFeature([NUM_FEATURES], tf.int64)}
_LABEL = {"label": tf.io.FixedLenFeature([1], tf.int64)}


def feed(dataset: tf.data.Dataset, mode: str, _metadata: object) -> tf.data.Dataset:
    def parse(record: tf.Tensor):
        spec = _FEATURES if mode == Mode.PREDICTION else {**_FEATURES, **_LABEL}
        parsed = tf.io.parse_single_example(record, spec)
        if mode == Mode.PREDICTION:
            return parsed["ids"]
        return parsed["ids"], tf.cast(parsed["label"], tf.float32)

    return dataset.map(parse)


def loss(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(tf.keras.losses.binary_crossentropy(labels, predictions))


def optimizer(lr: float = 0.01) -> tf.keras.optimizers.Optimizer:
    return tf.keras.optimizers.Adam(learning_rate=lr)


def eval_metrics_fn() -> dict:
    return {
        "auc": tf.keras.metrics.AUC(),
        "log_loss": lambda labels, predictions: tf.keras.losses.binary_crossentropy(
            tf.reshape(labels, [-1, 1]), predictions
        ),
        "accuracy": lambda labels, predictions: tf.equal(
            tf.cast(predictions > 0.5, tf.float32), tf.reshape(labels, tf.shape(predictions))
        ),
    }
