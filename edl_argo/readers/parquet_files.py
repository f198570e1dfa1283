"""Parquet files: every ``.parquet`` file under the dataset URL (or the one file it names) is a shard of
rows.

Nothing is downloaded whole: :class:`RangedFile` is a read-only, seekable file object over ranged reads
of one pinned file version, so ``pyarrow.parquet.ParquetFile`` reads the footer when a dataset is opened
(the row count, the schema, the row groups) and only the column chunks of the row groups a task asks for
when it is read, on local storage and S3 alike.

The schema maps Arrow types to :data:`~edl_argo.readers.base.COLUMN_TYPES`: every signed integer and
uint8/16/32 to int64, float16/float32 to float32, float64 to float64, bool to bool, string and binary (and
dictionaries of them) to string. Any other type (uint64, timestamps, lists, structs, ...) is a ConfigError
naming the column and type; ``--data-options columns=a,b`` leaves such columns out. All files of a dataset
need the same columns and types.

A null is a DataFormatError naming the file, column and row, unless ``fill_missing`` (a value of the
column's type) stands for it. The hint is empty: row group positions come from each file's footer, which a
worker's reader reads once per file version.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from edl_argo.errors import ConfigError, DataFormatError
from edl_argo.readers.base import (
    Column,
    DataFormat,
    OpenedDataset,
    RangeReader,
    ReaderSpec,
    Records,
    RecordSchema,
    ShardInfo,
)
from edl_argo.readers.files import PinnedFiles, list_data_files
from edl_argo.readers.text_values import PARSERS, list_option


def _is_parquet(key: str) -> bool:
    return key.lower().endswith(".parquet")


class RangedFile(io.RawIOBase):
    """One file version of :class:`PinnedFiles` as a read-only, seekable binary file: every read is one
    ranged read (pinned: ShardChangedError if the file was replaced). Not thread-safe (it has a
    position); :class:`ParquetReader` guards each with a lock."""

    def __init__(self, files: PinnedFiles, key: str, version: str = "", size: int | None = None) -> None:
        super().__init__()
        self.files, self.key, self.version = files, key, version
        self.size = files.size(key, version) if size is None else size
        self.position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = self.size - self.position
        size = min(size, self.size - self.position)
        if size <= 0:
            return b""
        data = self.files.read(self.key, self.position, size, self.version)
        self.position += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)


def column_type(field: pa.Field) -> str | None:
    """The :data:`~edl_argo.readers.base.COLUMN_TYPES` name of an Arrow field's type; None if none."""
    kind = field.type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if pa.types.is_signed_integer(kind) or kind in (pa.uint8(), pa.uint16(), pa.uint32()):
        return "int64"
    if pa.types.is_float16(kind) or pa.types.is_float32(kind):
        return "float32"
    if pa.types.is_float64(kind):
        return "float64"
    if pa.types.is_boolean(kind):
        return "bool"
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind):
        return "string"
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind):
        return "string"
    return None


def _columns(describe: str, schema: pa.Schema, names: Sequence[str]) -> tuple[Column, ...]:
    columns = []
    for name in names:
        if name not in schema.names:
            raise ConfigError(
                f"--data-options columns: {name!r} is not a column of {describe}; columns: "
                f"{', '.join(schema.names)}"
            )
        field = schema.field(name)
        dtype = column_type(field)
        if dtype is None:
            raise ConfigError(
                f"Parquet file {describe}: column {name!r} has type {field.type}, which no reader column "
                "holds (integers, floats, bool, string or binary); leave it out with --data-options "
                "columns=..."
            )
        columns.append(Column(name, dtype))
    return tuple(columns)


def _fill_value(column: Column, fill: str) -> Any:
    if column.dtype == "string":
        return fill
    fits, parse = PARSERS[column.dtype]
    if not fits(fill.strip()):
        raise ConfigError(
            f"--data-options fill_missing={fill!r} is not {column.dtype} (column {column.name!r})"
        )
    return parse(fill.strip())


class ParquetReader(RangeReader):
    """A worker's reader of Parquet row ranges: the row groups a range overlaps, its columns only."""

    def __init__(self, spec: ReaderSpec) -> None:
        super().__init__(spec)
        self.files = PinnedFiles(spec.url)
        fill = spec.options.get("fill_missing")
        self.fill: str | None = None if fill is None else str(fill)
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], tuple[pq.ParquetFile, np.ndarray, threading.Lock]] = {}

    def parquet_file(
        self, shard: str, version: str = "", size: int | None = None
    ) -> tuple[pq.ParquetFile, np.ndarray, threading.Lock]:
        """The opened file (its footer read once), the first row of each row group (and the row count
        last), and the lock its reads take."""
        with self._lock:
            if (shard, version) not in self._open:
                try:
                    parquet = pq.ParquetFile(RangedFile(self.files, shard, version, size))
                except (pa.ArrowException, OSError) as error:
                    if isinstance(error, DataFormatError):
                        raise
                    raise DataFormatError(
                        f"Parquet file {self.files.describe(shard)}: not readable as Parquet: {error}"
                    ) from None
                meta = parquet.metadata
                counts = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
                firsts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
                self._open[shard, version] = (parquet, firsts, threading.Lock())
            return self._open[shard, version]

    def read(self, shard: str, start: int, end: int, *, version: str = "", hint: str = "") -> Records:
        schema = self.spec.schema
        if start == end:
            return schema.empty()
        parquet, firsts, lock = self.parquet_file(shard, version)
        describe = self.files.describe(shard)
        if not 0 <= start < end <= firsts[-1]:
            raise DataFormatError(
                f"Parquet file {describe}: rows [{start}, {end}) asked for, it has {firsts[-1]}; it changed "
                "since the dataset was opened"
            )
        first = int(np.searchsorted(firsts, start, side="right")) - 1
        last = int(np.searchsorted(firsts, end, side="left"))  # groups [first, last) hold the range
        with lock:
            table = parquet.read_row_groups(range(first, last), columns=list(schema.names))
        table = table.slice(start - int(firsts[first]), end - start)
        return tuple(
            self._array(describe, column, table.column(column.name), start) for column in schema.columns
        )

    def _array(self, describe: str, column: Column, values: pa.ChunkedArray, start: int) -> np.ndarray:
        if pa.types.is_dictionary(values.type):
            values = values.cast(values.type.value_type)
        if values.null_count:
            if self.fill is None:
                row = start + int(pc.index(pc.is_null(values), True).as_py())
                raise DataFormatError(
                    f"Parquet file {describe} row {row}, column {column.name!r}: missing value (null); "
                    "pass --data-options fill_missing=VALUE to stand for every missing value"
                )
            values = pc.fill_null(values, pa.scalar(_fill_value(column, self.fill), values.type))
        array = values.to_numpy(zero_copy_only=False)
        if column.dtype == "string":
            return array.astype(object)
        return array.astype(column.numpy_dtype, copy=False)


class OpenedParquet(OpenedDataset):
    def __init__(self, spec: ReaderSpec, shards: Sequence[ShardInfo], reader: ParquetReader) -> None:
        super().__init__(spec, shards, reader)
        self._files = reader.files

    def describe(self, shard: str = "") -> str:
        return self._files.describe(shard) if shard else self.spec.url


class ParquetFormat(DataFormat):
    name = "parquet"
    options = ("columns", "fill_missing")

    def open(self, url: str, options: dict[str, Any], what: str = "") -> OpenedDataset:
        listing = list_data_files(url, _is_parquet, what, self.name)
        fill = options.get("fill_missing")
        base = ReaderSpec(
            self.name, listing.folder_url, options={} if fill is None else {"fill_missing": str(fill)}
        )
        reader = ParquetReader(base)
        shards: list[ShardInfo] = []
        arrow: pa.Schema | None = None
        first = ""
        for info in listing.files:
            parquet = reader.parquet_file(info.key, info.version, info.size)[0]
            found = parquet.schema_arrow
            describe = reader.files.describe(info.key)
            if arrow is None:
                arrow, first = found, describe
            elif [(f.name, column_type(f)) for f in found] != [(f.name, column_type(f)) for f in arrow]:
                raise DataFormatError(
                    f"Parquet file {describe}: its columns ({found.to_string(show_schema_metadata=False)}) "
                    f"differ from those of {first}; every file of a dataset needs the same columns".replace(
                        "\n", ", "
                    )
                )
            shards.append(ShardInfo(info.key, parquet.metadata.num_rows, info.version))
        assert arrow is not None
        names = list_option(options["columns"]) if options.get("columns") else arrow.names
        schema = RecordSchema(_columns(first, arrow, names))
        if fill is not None:
            for column in schema.columns:
                _fill_value(column, str(fill))
        spec = ReaderSpec(self.name, listing.folder_url, schema, base.options)
        reader.spec = spec  # its opened files are the ones just pinned
        return OpenedParquet(spec, shards, reader)

    def range_reader(self, spec: ReaderSpec) -> RangeReader:
        return ParquetReader(spec)

    def detect(self, url: str, names: Sequence[str]) -> bool:
        return any(_is_parquet(name) for name in names)
