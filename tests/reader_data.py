"""Datasets of the same records in every file format, for the reader tests and the chaos suite."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from edl_argo.data.commands import digits_records
from edl_argo.data.examples import decode_example

#: The file formats a digits dataset is written in by :func:`write_digits_as`.
FILE_FORMATS = ("tfrecord", "csv", "parquet")
PIXELS = tuple(f"p{i}" for i in range(64))


def digits_table(records: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """The digits records (``tf.train.Example``) as a float32 pixel matrix and int64 labels."""
    decoded = [decode_example(record) for record in records]
    pixels = np.array([d["image"] for d in decoded], dtype=np.float32)
    labels = np.array([d["label"][0] for d in decoded], dtype=np.int64)
    return pixels, labels


def write_records_as(fmt: str, folder: Path, records: list[bytes], files: int) -> None:
    """``records`` (digits examples) into ``folder`` as ``files`` files of format ``fmt``, in order."""
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
        if fmt == "csv":
            with open(str(path) + ".csv", "w", newline="") as file:
                writer = csv.writer(file)
                writer.writerow([*PIXELS, "label"])
                writer.writerows(
                    [*(repr(float(v)) for v in row), int(y)] for row, y in zip(pixels, labels, strict=True)
                )
        elif fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            columns = {name: pa.array(pixels[:, i]) for i, name in enumerate(PIXELS)}
            pq.write_table(
                pa.table({**columns, "label": pa.array(labels)}), str(path) + ".parquet", row_group_size=128
            )
        else:
            raise ValueError(f"no writer for {fmt}")


def write_digits_as(fmt: str, root: Path) -> Path:
    """The digits dataset (the same split as ``edl-argo data digits``) as ``root/train`` (4 files) and
    ``root/test`` (2 files) in format ``fmt``; returns ``root``."""
    train, test = digits_records(test_fraction=0.2, seed=0)
    write_records_as(fmt, root / "train", train, 4)
    write_records_as(fmt, root / "test", test, 2)
    return root
