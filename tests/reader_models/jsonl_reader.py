"""The tabular model (a copy of tests/reader_models/tabular.py) with an ElasticDL custom data reader of
its own: every ``*.jsonl`` file of the data folder is a shard, one JSON object per line, which the
reader yields as a serialized ``tf.train.Example``. Used by tests/test_reader_custom.py.

``custom_data_reader`` has ElasticDL's signature; ``split`` (a data option) splits each file into shards
of that many lines, named by the file (ElasticDL's older list form, names repeating); ``output`` makes
``read_records`` yield something else than strings (``numbers``) or ``records_output_types`` another type
(``float``), for the tests of refusals. ``OPENED`` counts the readers made in this process.
"""

import json
import os

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


OPENED = []


def encode(row: dict) -> bytes:
    feature = {name: tf.train.Feature(float_list=tf.train.FloatList(value=[row[name]])) for name in FEATURES}
    feature["label"] = tf.train.Feature(int64_list=tf.train.Int64List(value=[row["label"]]))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


class JsonLinesReader:
    """ElasticDL's AbstractDataReader shape: create_shards(), read_records(task), records_output_types."""

    def __init__(self, folder: str, records_per_task=None, split: str = "", output: str = "") -> None:
        self.folder = folder
        self.records_per_task = records_per_task
        self.split = int(split or 0)
        self.output = output

    def _lines(self, name: str) -> list[str]:
        with open(os.path.join(self.folder, name)) as file:
            return [line for line in file if line.strip()]

    def create_shards(self):
        names = sorted(n for n in os.listdir(self.folder) if n.endswith(".jsonl"))
        if not self.split:
            return {name: (0, len(self._lines(name))) for name in names}
        shards = []
        for name in names:
            count = len(self._lines(name))
            shards += [(name, start, min(self.split, count - start)) for start in range(0, count, self.split)]
        return shards

    def read_records(self, task):
        for line in self._lines(task.shard.name)[task.shard.start : task.shard.end]:
            if self.output == "numbers":
                yield [1.0, 2.0]
            else:
                yield encode(json.loads(line))

    @property
    def records_output_types(self):
        return tf.float32 if self.output == "float" else tf.string

    @property
    def metadata(self):
        return None


def custom_data_reader(data_origin, records_per_task=None, **kwargs):
    OPENED.append((data_origin, records_per_task, kwargs))
    return JsonLinesReader(data_origin, records_per_task, **kwargs)
