"""Datasets of the same records in every file format, for the reader tests and the chaos suite: the digits
as ``edl-argo data digits --format`` writes them (:mod:`edl_argo.data.file_writers`)."""

from __future__ import annotations

from pathlib import Path

from edl_argo.data.commands import digits_records
from edl_argo.data.file_writers import digits_table, pixel_columns, write_records_as
from edl_argo.storage import open_storage

#: The file formats a digits dataset is written in by :func:`write_digits_as` (the record formats; PNG
#: images hold the same pixels, rounded).
FILE_FORMATS = ("tfrecord", "csv", "parquet")


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
    storage = open_storage(str(root))
    write_records_as(fmt, storage, "train", train, 4)
    write_records_as(fmt, storage, "test", test, 2)
    return root
