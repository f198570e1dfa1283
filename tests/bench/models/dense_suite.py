"""The dense models of the benchmarks' model suite, on scikit-learn's 8×8 digits: models no other benchmark
tunes for, named with ``--model-def dense_suite.py:FACTORY``.

* ``big_mlp``: 64 → Dense4096 → Dense4096 → Dense2048 → Dense10 (25.4 M params, ResNet-50's size): a step
  that moves the whole model twice (about 100 MB of gradients to the PS and 100 MB of parameters back);
* ``resnet_bn``: a ResNet-style CNN, two residual blocks of Conv-BatchNormalization-ReLU with a projection
  shortcut, global average pooling (BatchNormalization's moving statistics are non-trainable state);
* ``transformer``: a Transformer encoder over the image's 8 rows as tokens: a 64-wide embedding with learnt
  positions, two blocks of 4-head self-attention and a feed-forward layer, each with dropout, a residual
  and LayerNormalization;
* ``lstm``: the image's 8 rows as a sequence through LSTM(128) → LSTM(128).

All follow ElasticDL's model-zoo contract with Adam and take the records, loss and metric from
``examples/model_zoo/digits.py``; ``feed`` does not shuffle, so the job reads what ``model.fit`` reads.
"""

import importlib.util
from pathlib import Path

import tensorflow as tf

_ZOO_FILE = Path(__file__).resolve().parents[3] / "examples" / "model_zoo" / "digits.py"
_spec = importlib.util.spec_from_file_location("bench_dense_suite_digits", _ZOO_FILE)
assert _spec is not None and _spec.loader is not None
zoo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(zoo)

loss = zoo.loss
eval_metrics_fn = zoo.eval_metrics_fn
layers = tf.keras.layers


def big_mlp() -> tf.keras.Model:
    inputs = tf.keras.Input(shape=(64,), name="image")
    x = layers.Dense(4096, activation="relu")(inputs)
    x = layers.Dense(4096, activation="relu")(x)
    x = layers.Dense(2048, activation="relu")(x)
    return tf.keras.Model(inputs, layers.Dense(10, name="logits")(x), name="big_mlp")


def _conv_bn(x: tf.Tensor, filters: int, strides: int = 1, relu: bool = True) -> tf.Tensor:
    x = layers.Conv2D(filters, 3, strides=strides, padding="same", use_bias=False)(x)
    x = layers.BatchNormalization()(x)
    return layers.ReLU()(x) if relu else x


def _residual_block(x: tf.Tensor, filters: int, strides: int) -> tf.Tensor:
    shortcut = layers.Conv2D(filters, 1, strides=strides, use_bias=False)(x)
    shortcut = layers.BatchNormalization()(shortcut)
    y = _conv_bn(x, filters, strides)
    y = _conv_bn(y, filters, relu=False)
    return layers.ReLU()(layers.Add()([y, shortcut]))


def resnet_bn() -> tf.keras.Model:
    inputs = tf.keras.Input(shape=(64,), name="image")
    x = layers.Reshape((8, 8, 1))(inputs)
    x = _conv_bn(x, 32)
    x = _residual_block(x, 64, strides=1)
    x = _residual_block(x, 128, strides=2)
    x = layers.GlobalAveragePooling2D()(x)
    return tf.keras.Model(inputs, layers.Dense(10, name="logits")(x), name="resnet_bn")


def _encoder_block(x: tf.Tensor, width: int, heads: int, dropout: float) -> tf.Tensor:
    attended = layers.MultiHeadAttention(heads, width // heads, dropout=dropout)(x, x)
    x = layers.LayerNormalization(epsilon=1e-6)(x + layers.Dropout(dropout)(attended))
    forward = layers.Dense(width * 2, activation="relu")(x)
    forward = layers.Dense(width)(forward)
    return layers.LayerNormalization(epsilon=1e-6)(x + layers.Dropout(dropout)(forward))


class _Positions(layers.Layer):
    """Adds a learnt embedding of each token's position."""

    def build(self, input_shape: tuple) -> None:
        self.table = self.add_weight(
            name="positions", shape=tuple(input_shape[1:]), initializer="random_normal"
        )

    def call(self, tokens: tf.Tensor) -> tf.Tensor:
        return tokens + self.table


def transformer() -> tf.keras.Model:
    inputs = tf.keras.Input(shape=(64,), name="image")
    tokens = layers.Dense(64)(layers.Reshape((8, 8))(inputs))
    x = _Positions()(tokens)
    for _ in range(2):
        x = _encoder_block(x, width=64, heads=4, dropout=0.1)
    x = layers.GlobalAveragePooling1D()(x)
    return tf.keras.Model(inputs, layers.Dense(10, name="logits")(x), name="transformer")


def lstm() -> tf.keras.Model:
    inputs = tf.keras.Input(shape=(64,), name="image")
    x = layers.Reshape((8, 8))(inputs)
    x = layers.LSTM(128, return_sequences=True)(x)
    x = layers.LSTM(128)(x)
    return tf.keras.Model(inputs, layers.Dense(10, name="logits")(x), name="lstm")


custom_model = big_mlp


def optimizer() -> tf.keras.optimizers.Optimizer:
    return tf.keras.optimizers.Adam(learning_rate=1e-4)


def feed(dataset: tf.data.Dataset, mode: str, _metadata: object) -> tf.data.Dataset:
    return dataset.map(lambda record: zoo.parse(record, mode))
