"""The tabular model (tests/reader_models/tabular.py) with an ElasticDL custom data reader of
its own: every ``*.jsonl`` file of the data folder is a shard, one JSON object per line, which the
reader yields as a serialized ``tf.train.Example``. Used by tests/test_reader_custom.py.

``custom_data_reader`` has ElasticDL's signature; ``split`` (a data option) splits each file into shards
of that many lines, named by the file (ElasticDL's older list form, names repeating); ``output`` makes
``read_records`` yield something else than strings (``numbers``) or ``records_output_types`` another type
(``float``), for the tests of refusals. ``OPENED`` counts the readers made in this process.
"""

import importlib.util
import json
import os
from pathlib import Path

import tensorflow as tf

_spec = importlib.util.spec_from_file_location("tabular", Path(__file__).with_name("tabular.py"))
tabular = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tabular)

FEATURES = tabular.FEATURES
custom_model, loss, optimizer, feed, eval_metrics_fn = (
    tabular.custom_model,
    tabular.loss,
    tabular.optimizer,
    tabular.feed,
    tabular.eval_metrics_fn,
)


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
