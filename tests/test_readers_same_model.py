"""The same rows in every format train the same model (issue 33's "same model" goal).

One table of rows is written as RecordIO, TFRecord (by TensorFlow's own writer), CSV, Parquet and a SQLite
table (read in the order of its key column, ``--data-options key=id``). A job of one worker and one PS,
without shuffling, trains on each; every variable of the exported ``model.keras`` must be bit-identical
across formats (each format delivers the same records in the same order, so the PS applies the same
gradients in the same order), and every record is trained once per epoch (the ledger's counts at both
ends).
"""

from __future__ import annotations

import csv
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from edl_argo import log
from edl_argo.data.commands import write_dataset
from edl_argo.data.examples import encode_example
from edl_argo.master.config import TrainConfig
from edl_argo.master.export import KERAS_FILE
from edl_argo.master.job import TrainingJob
from edl_argo.readers import open_data
from edl_argo.recordio import Compressor
from edl_argo.storage import LocalStorage
from tests.engine_helpers import assert_no_record_lost, model_dir

MODEL = str(Path(__file__).parent / "reader_models" / "tabular.py")
ROWS = 420
FEATURES = ("f0", "f1", "f2", "f3")


def table() -> tuple[np.ndarray, np.ndarray]:
    """Four float32 features and a label (0-2) that depends on them."""
    rng = np.random.default_rng(3)
    features = rng.normal(size=(ROWS, len(FEATURES))).astype(np.float32)
    labels = np.argmax(features[:, :3] + 0.3 * features[:, 3:], axis=1).astype(np.int64)
    return features, labels


def examples(features: np.ndarray, labels: np.ndarray) -> list[bytes]:
    return [
        encode_example({**{n: [float(v)] for n, v in zip(FEATURES, row, strict=True)}, "label": [int(label)]})
        for row, label in zip(features, labels, strict=True)
    ]


def write_formats(root: Path) -> dict[str, str]:
    """The table in every format; format -> the URL a job is given."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import tensorflow as tf

    features, labels = table()
    records = examples(features, labels)
    urls = {}
    write_dataset(LocalStorage(root / "recordio"), "", records, 1, Compressor.SNAPPY, overwrite=False)
    urls["recordio"] = str(root / "recordio")
    (root / "tfrecord").mkdir()
    with tf.io.TFRecordWriter(str(root / "tfrecord" / "rows.tfrecord")) as writer:
        for record in records:
            writer.write(record)
    urls["tfrecord"] = str(root / "tfrecord")
    (root / "csv").mkdir()
    with (root / "csv" / "rows.csv").open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow([*FEATURES, "label"])
        writer.writerows(
            [*(repr(float(v)) for v in row), int(label)] for row, label in zip(features, labels, strict=True)
        )
    urls["csv"] = str(root / "csv")
    columns = {name: pa.array(features[:, i]) for i, name in enumerate(FEATURES)}
    (root / "parquet").mkdir()
    pq.write_table(
        pa.table({**columns, "label": pa.array(labels)}),
        root / "parquet" / "rows.parquet",
        row_group_size=100,
    )
    urls["parquet"] = str(root / "parquet")
    with sqlite3.connect(root / "rows.db") as connection:
        connection.execute(
            "CREATE TABLE rows (id INTEGER PRIMARY KEY, f0 REAL, f1 REAL, f2 REAL, f3 REAL, label INTEGER)"
        )
        connection.executemany(
            "INSERT INTO rows VALUES (?, ?, ?, ?, ?, ?)",
            [
                (i, *map(float, row), int(label))
                for i, (row, label) in enumerate(zip(features, labels, strict=True))
            ],
        )
    urls["sql"] = f"sqlite:///{root / 'rows.db'}#rows"
    return urls


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[np.ndarray], dict]]:
    import keras

    log.configure("INFO")
    root = tmp_path_factory.mktemp("formats")
    results = {}
    for name, url in write_formats(root).items():
        options = "key=id" if name == "sql" else ""
        assert open_data(url, options={"key": "id"} if options else None).format == name  # found from the URL
        output = root / f"out-{name}"
        config = TrainConfig(
            model_def=MODEL,
            training_data=url,
            output=str(output),
            job_name=f"test-format-{name}",
            num_epochs=2,
            shuffle=False,
            minibatch_size=32,
            num_minibatches_per_task=2,
            num_workers=1,
            num_ps=1,
            data_options=options,
        )
        metrics = TrainingJob.load(config).run()
        model = keras.saving.load_model(model_dir(output) / KERAS_FILE, compile=False)
        results[name] = ([np.asarray(v) for v in model.get_weights()], metrics)
    return results


def test_every_format_trains_every_record_once_per_epoch(trained) -> None:
    for name, (_, metrics) in trained.items():
        assert metrics["records_per_epoch"] == ROWS, name
        assert_no_record_lost(metrics)


def test_every_format_exports_the_same_variables_as_recordio(trained) -> None:
    reference, _ = trained["recordio"]
    for name, (weights, _) in trained.items():
        assert len(weights) == len(reference), name
        for got, want in zip(weights, reference, strict=True):
            np.testing.assert_array_equal(got, want, err_msg=name)
