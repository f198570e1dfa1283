"""The reader contract: a dataset of one format, listed into shards with record counts, read by record range.

Every data format a job reads (RecordIO, TFRecord, CSV, Parquet, image folders, SQL tables) is a
:class:`DataFormat` with two halves:

- :meth:`DataFormat.open` runs where the dataset is planned (the master, ``edl-argo evaluate|predict``,
  ``edl-argo data inspect``): it lists the shards, counts their records (reading or building an index),
  pins each shard's version and infers the :class:`RecordSchema`. What it learns that a worker needs to
  read is put in the :class:`ReaderSpec` (sent with every task) and, per record range, in a *hint*
  (:meth:`OpenedDataset.locate`: byte offsets, key bounds), so that a worker never lists or indexes a
  dataset itself.
- :meth:`DataFormat.range_reader` runs on a worker: from the spec alone it reads any record range of a
  shard with as few ranged reads as the format allows.

Task dispatch, requeues, the ledger and version pinning only see shard keys, record counts and ranges, so
they work the same for every format.

What ``feed`` receives per record is fixed by the schema: one serialized string (a ``tf.train.Example``
for RecordIO and TFRecord) when :attr:`RecordSchema.columns` is empty, else a dict of named scalar
tensors, one per column (tables, and ``image``/``label`` for image folders).
"""

from __future__ import annotations

import abc
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edl_argo.errors import ConfigError

#: The column types a schema may hold: numpy dtype names, each with a TensorFlow dtype of the same name.
COLUMN_TYPES = ("string", "int64", "int32", "float64", "float32", "bool")


@dataclass(frozen=True)
class Column:
    """One named, typed field of a record of a table."""

    name: str
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in COLUMN_TYPES:
            raise ValueError(
                f"column {self.name!r}: type {self.dtype!r} is not one of {', '.join(COLUMN_TYPES)}"
            )

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(object) if self.dtype == "string" else np.dtype(self.dtype)


@dataclass(frozen=True)
class RecordSchema:
    """What one record is: a serialized string (``columns`` empty) or a row of named, typed columns."""

    columns: tuple[Column, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(column.name for column in self.columns)

    @property
    def dtypes(self) -> tuple[str, ...]:
        """One type per array of a :data:`Records` value: ``("string",)`` for serialized records."""
        return tuple(column.dtype for column in self.columns) or ("string",)

    def empty(self) -> Records:
        """Zero records of this schema."""
        return tuple(np.empty(0, dtype=_numpy(dtype)) for dtype in self.dtypes)

    def to_json(self) -> list[list[str]]:
        return [[column.name, column.dtype] for column in self.columns]

    @classmethod
    def from_json(cls, value: Sequence[Sequence[str]]) -> RecordSchema:
        return cls(tuple(Column(str(name), str(dtype)) for name, dtype in value))


#: The schema of serialized records (RecordIO, TFRecord): one string per record.
SERIALIZED = RecordSchema()


def _numpy(dtype: str) -> np.dtype:
    return np.dtype(object) if dtype == "string" else np.dtype(dtype)


#: Some records of a dataset: one 1-D array per :attr:`RecordSchema.dtypes` entry, all of the same length
#: (the record count). Serialized records are one object array of ``bytes``; a string column is an object
#: array of ``bytes`` or ``str``.
Records = tuple[np.ndarray, ...]


def num_records(records: Records) -> int:
    return len(records[0]) if records else 0


def slice_records(records: Records, start: int, end: int) -> Records:
    return tuple(array[start:end] for array in records)


def serialized_records(values: Sequence[bytes]) -> Records:
    """``values`` as the :data:`Records` of a schema without columns."""
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return (array,)


@dataclass(frozen=True)
class ShardInfo:
    """One shard of an opened dataset: its key (what tasks name), record count and pinned version."""

    key: str
    records: int
    version: str = ""


@dataclass(frozen=True)
class ReaderSpec:
    """All a worker needs to read record ranges of a dataset; sent with every task as JSON.

    ``url`` is the dataset's URL as the user gave it (credentials are never part of it); ``options`` are
    the format's own (a CSV delimiter, projected columns, a SQL key column), JSON values only.
    """

    format: str
    url: str
    schema: RecordSchema = SERIALIZED
    options: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        document = {
            "format": self.format,
            "url": self.url,
            "schema": self.schema.to_json(),
            "options": self.options,
        }
        return json.dumps(document, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ReaderSpec:
        document = json.loads(text)
        return cls(
            format=str(document["format"]),
            url=str(document["url"]),
            schema=RecordSchema.from_json(document.get("schema", [])),
            options=dict(document.get("options", {})),
        )


class RangeReader(abc.ABC):
    """Reads record ranges of one dataset's shards (a worker's half of a format). Thread-safe: a worker's
    input pipeline and its evaluation read through one reader."""

    def __init__(self, spec: ReaderSpec) -> None:
        self.spec = spec

    @abc.abstractmethod
    def read(self, shard: str, start: int, end: int, *, version: str = "", hint: str = "") -> Records:
        """Records ``[start, end)`` of ``shard`` in :attr:`spec`'s schema. ``version``: the shard's pinned
        version (empty: any); a replaced shard is a ``ShardChangedError`` naming it. ``hint``: what
        :meth:`OpenedDataset.locate` gave for this range (empty: none; the reader then finds the range
        itself, more slowly where the format has no index of its own). Bad data is a
        :class:`~edl_argo.errors.DataFormatError` naming the file (or table) and record or line."""


class OpenedDataset:
    """A dataset opened for planning: its shards, listed and pinned once, and where each range lies."""

    def __init__(self, spec: ReaderSpec, shards: Sequence[ShardInfo], reader: RangeReader) -> None:
        """``reader``: this side's reader of the ranges, made from ``spec`` as a worker's would be (it
        keeps what it learns of a shard: an index, a file's footer, an engine)."""
        if not shards:
            raise ConfigError(f"{spec.url}: no {spec.format} data there")
        self.spec = spec
        self.shards = tuple(shards)
        self._reader = reader

    @property
    def format(self) -> str:
        return self.spec.format

    @property
    def schema(self) -> RecordSchema:
        return self.spec.schema

    @property
    def records(self) -> dict[str, int]:
        """Shard key -> record count, in shard order."""
        return {shard.key: shard.records for shard in self.shards}

    @property
    def versions(self) -> dict[str, str]:
        """Shard key -> the version pinned when the dataset was opened."""
        return {shard.key: shard.version for shard in self.shards}

    @property
    def names(self) -> dict[str, str]:
        """Shard key -> the shard's name as outputs (prediction files) call it; its key by default."""
        return {shard.key: shard.key for shard in self.shards}

    def describe(self, shard: str = "") -> str:
        """A URL naming the dataset, or one of its shards, for messages."""
        return f"{self.spec.url.rstrip('/')}/{shard}" if shard else self.spec.url

    def locate(self, shard: str, start: int, end: int) -> str:
        """The hint a worker's :meth:`RangeReader.read` takes for records ``[start, end)`` of ``shard``:
        byte offsets or key bounds from this side's index, as a short string. Empty by default (the
        format needs none)."""
        return ""

    def range_reader(self) -> RangeReader:
        """The reader of this dataset's ranges, as a worker would make it from :attr:`spec`."""
        return self._reader

    def read(self, shard: str, start: int, end: int) -> Records:
        """Records ``[start, end)`` of ``shard`` read here, pinned and located as a worker reads them."""
        version = self.versions.get(shard, "")
        return self._reader.read(shard, start, end, version=version, hint=self.locate(shard, start, end))


class DataFormat(abc.ABC):
    """One format a dataset can be in; registered by :attr:`name` in :mod:`edl_argo.readers.registry`."""

    #: What ``--data-format`` calls it.
    name: str = ""
    #: The ``--data-options`` it takes; any other is refused before it opens (:func:`registry.open_data`).
    #: None: any (they are the user's own, as a custom reader's keyword arguments).
    options: tuple[str, ...] | None = ()

    @abc.abstractmethod
    def open(self, url: str, options: dict[str, Any], what: str = "") -> OpenedDataset:
        """List, index and pin the dataset at ``url``. ``what``: the flag that named it, for messages.
        A missing, empty or unreadable dataset is one ConfigError or DataFormatError naming the URL (and
        the file at fault)."""

    @abc.abstractmethod
    def range_reader(self, spec: ReaderSpec) -> RangeReader:
        """A worker's reader of the dataset ``spec`` describes."""

    def detect(self, url: str, names: Sequence[str]) -> bool:
        """Whether the dataset at ``url``, whose objects (relative names, a sample) are ``names``, is in
        this format. Only consulted without ``--data-format``."""
        return False
