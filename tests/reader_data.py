"""Datasets of the same records in every file format, for the reader tests and the chaos suite."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from edl_argo.data.commands import digits_records
from edl_argo.data.examples import decode_example

#: The file formats a digits dataset is written in by :func:`write_digits_as`.
FILE_FORMATS = ("tfrecord", "csv", "parquet")


def pixel_columns(count: int) -> tuple[str, ...]:
    """The column names of an image's ``count`` pixels in a table: ``p0``, ``p1``, ..."""
    return tuple(f"p{i}" for i in range(count))


def digits_table(records: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Image records (``tf.train.Example`` with ``image`` floats and ``label``: the digits, or the
    benchmarks' MNIST-style images) as a float32 pixel matrix and int64 labels."""
    decoded = [decode_example(record) for record in records]
    pixels = np.array([d["image"] for d in decoded], dtype=np.float32)
    labels = np.array([d["label"][0] for d in decoded], dtype=np.int64)
    return pixels, labels


def write_records_as(fmt: str, folder: Path, records: list[bytes], files: int) -> None:
    """``records`` (image examples, :func:`digits_table`) into ``folder`` as ``files`` files of format
    ``fmt``, in order; a table has one column per pixel (:func:`pixel_columns`) and ``label``."""
    folder.mkdir(parents=True, exist_ok=True)
    parts = np.array_split(np.arange(len(records)), files)
    for number, part in enumerate(parts):
        chosen = [records[i] for i in part]
        path = folder / f"part-{number:03d}"
        if fmt == "tfrecord":
            import tensorflow as tf

            with tf.io.TFRecordWriter(str(path) + ".tfrecord") as writer:
                for record in chosen:
                    writer.write(record)
            continue
        pixels, labels = digits_table(chosen)
        columns = pixel_columns(pixels.shape[1])
        if fmt == "csv":
            with open(str(path) + ".csv", "w", newline="") as file:
                writer = csv.writer(file)
                writer.writerow([*columns, "label"])
                writer.writerows(
                    [*(repr(float(v)) for v in row), int(y)] for row, y in zip(pixels, labels, strict=True)
                )
        elif fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            arrays = {name: pa.array(pixels[:, i]) for i, name in enumerate(columns)}
            pq.write_table(
                pa.table({**arrays, "label": pa.array(labels)}), str(path) + ".parquet", row_group_size=128
            )
        else:
            raise ValueError(f"no writer for {fmt}")


def write_digits_table(database: Path) -> str:
    """The digits dataset (the split of ``edl-argo data digits``) as the tables ``train`` and ``test`` of a
    SQLite database, with a key column ``id`` in record order; returns the database's URL (a job reads
    ``URL#train`` with ``--data-options key=id``)."""
    import sqlite3

    columns = pixel_columns(64)
    with sqlite3.connect(database) as connection:
        for table, records in zip(("train", "test"), digits_records(test_fraction=0.2, seed=0), strict=True):
            pixels, labels = digits_table(records)
            names = ", ".join(f"{name} REAL" for name in columns)
            connection.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, {names}, label INTEGER)")
            connection.executemany(
                f"INSERT INTO {table} VALUES ({', '.join('?' * (len(columns) + 2))})",
                [
                    (i, *map(float, row), int(y))
                    for i, (row, y) in enumerate(zip(pixels, labels, strict=True))
                ],
            )
    return f"sqlite:///{database}"


def write_digits_as(fmt: str, root: Path) -> Path:
    """The digits dataset (the same split as ``edl-argo data digits``) as ``root/train`` (4 files) and
    ``root/test`` (2 files) in format ``fmt``; returns ``root``."""
    train, test = digits_records(test_fraction=0.2, seed=0)
    write_records_as(fmt, root / "train", train, 4)
    write_records_as(fmt, root / "test", test, 2)
    return root
