"""The digits records written as files of each format the readers read (``edl-argo data digits --format``).

The same records, in the same order, as the RecordIO dataset: ``tf.train.Example`` records in TFRecord
files; rows with the 64 pixels in columns ``p0``..``p63`` and ``label`` in CSV and Parquet files; or one
PNG per record (8×8, grey, the pixels scaled from 0–16 to 0–255) in class folders ``0/``..``9/``. A
split of ``records`` goes to ``files`` files named ``part-000.<ext>``, ... (images: ``<label>/<n>.png``).
"""

from __future__ import annotations

import csv
import io
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edl_argo.data.examples import decode_example
from edl_argo.errors import ConfigError
from edl_argo.storage import Storage

#: The formats ``edl-argo data digits --format`` writes; ``recordio`` is the sealed RecordIO dataset.
DIGITS_FORMATS = ("recordio", "tfrecord", "csv", "parquet", "images")
#: The file formats among them (written by :func:`write_records_as`).
FILE_FORMATS = ("tfrecord", "csv", "parquet", "images")


def pixel_columns(count: int) -> tuple[str, ...]:
    """The column names of an image's ``count`` pixels in a table: ``p0``, ``p1``, ..."""
    return tuple(f"p{i}" for i in range(count))


def digits_table(records: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Image records (``tf.train.Example`` with ``image`` floats and ``label``: the digits, or any image of
    that layout) as a float32 pixel matrix and int64 labels."""
    decoded = [decode_example(record) for record in records]
    pixels = np.array([d["image"] for d in decoded], dtype=np.float32).reshape(len(decoded), -1)
    labels = np.array([d["label"][0] for d in decoded], dtype=np.int64)
    return pixels, labels


def write_records_as(
    fmt: str, storage: Storage, prefix: str, records: Sequence[bytes], files: int, overwrite: bool = False
) -> int:
    """``records`` (digits examples) under ``prefix`` of ``storage`` as files of format ``fmt``, in order;
    returns the number of files. Files already under ``prefix`` are an error unless ``overwrite``: then
    they are removed first (a dataset of another format included)."""
    if fmt not in FILE_FORMATS:
        raise ConfigError(f"--format {fmt}: not a file format ({', '.join(FILE_FORMATS)})")
    prefix = prefix.rstrip("/") + "/"
    existing = storage.list(prefix)
    if existing and not overwrite:
        raise ConfigError(
            f"{storage.describe(prefix)} holds files already (pass --overwrite to replace them)"
        )
    for info in existing:
        storage.delete(info.key)
    if fmt == "images":
        return _write_images(storage, prefix, records)
    parts = [part for part in np.array_split(np.arange(len(records)), max(1, files)) if len(part)]
    for number, part in enumerate(parts):
        chosen = [records[i] for i in part]
        storage.write(f"{prefix}part-{number:03d}.{fmt}", _file_bytes(fmt, chosen))
    return len(parts)


def _file_bytes(fmt: str, records: list[bytes]) -> bytes:
    if fmt == "tfrecord":
        import tensorflow as tf

        with tempfile.TemporaryDirectory(prefix="edl-tfrecord-") as tmp:
            path = Path(tmp) / "part.tfrecord"
            with tf.io.TFRecordWriter(str(path)) as writer:
                for record in records:
                    writer.write(record)
            return path.read_bytes()
    pixels, labels = digits_table(records)
    if fmt == "csv":
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow([*pixel_columns(pixels.shape[1]), "label"])
        writer.writerows(
            [*(repr(float(v)) for v in row), int(y)] for row, y in zip(pixels, labels, strict=True)
        )
        return text.getvalue().encode()
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {name: pa.array(pixels[:, i]) for i, name in enumerate(pixel_columns(pixels.shape[1]))}
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({**columns, "label": pa.array(labels)}), sink, row_group_size=128)
    return sink.getvalue().to_pybytes()


def _write_images(storage: Storage, prefix: str, records: Sequence[bytes]) -> int:
    import tensorflow as tf

    pixels, labels = digits_table(records)
    grey = np.clip(np.rint(pixels * (255.0 / 16.0)), 0, 255).astype(np.uint8).reshape(-1, 8, 8, 1)
    for number, (image, label) in enumerate(zip(grey, labels, strict=True)):
        storage.write(f"{prefix}{label}/{number:05d}.png", tf.io.encode_png(image).numpy())
    return len(records)
