"""CSV files: every ``.csv`` file under the dataset URL (or the one file it names) is a shard of rows.

Opening (the master's half) reads every file once, in blocks of :data:`BLOCK_SIZE`, and builds a sparse
:class:`~edl_argo.readers.files.OffsetIndex`: the byte offset and 1-based line number of every 64th data
row. The scan is quote-aware: a quoted field may hold delimiters, newlines and ``""`` escapes, so a newline
ends a row only where the count of ``"`` seen so far is even (blocks without a quote take a fast path).
It also checks the header (the first line: non-empty, unique names; every file of a dataset has the same
header) and decides the columns' types from the first :data:`SAMPLE_ROWS` rows of each file by the rules
of :mod:`edl_argo.readers.text_values` (int64, else float32, else string), unless the ``schema`` option
gives them.

Options (``--data-options``): ``delimiter`` (one character, default ``,``; ``\\t`` or ``tab`` for tabs),
``schema`` (``name:type,name:type``, types from :data:`~edl_argo.readers.base.COLUMN_TYPES`; columns it
leaves out are inferred), ``columns`` (``a,b,c``: only these columns, in this order) and ``fill_missing``
(the value an empty field of a numeric column stands for; without it an empty numeric field is an error).

The spec a worker gets holds the header (``options["header"]``), the delimiter, the fill value and, in its
schema, the projected columns and their types. A task's hint (:meth:`OpenedCsv.locate`) is a
:class:`~edl_argo.readers.files.RangeHint`: the bytes of the index entries around the range (whole rows
only, since index entries are row starts), the rows to skip there and the line number where they start.
Without a hint a worker streams the file from its start, past the header. Every error names the file's
URL and the line of the file (quoted newlines count), and the column where one is at fault. A UTF-8
byte-order mark is dropped; blank lines at the end of a file are ignored, a blank line between rows is an
error.
"""

from __future__ import annotations

import codecs
import csv
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edl_argo.errors import ConfigError, DataFormatError
from edl_argo.readers.base import (
    COLUMN_TYPES,
    Column,
    DataFormat,
    OpenedDataset,
    RangeReader,
    ReaderSpec,
    Records,
    RecordSchema,
    ShardInfo,
)
from edl_argo.readers.files import INDEX_STRIDE, OffsetIndex, PinnedFiles, RangeHint, list_data_files
from edl_argo.readers.text_values import PARSERS, column_values, infer_type, list_option

#: Bytes read at a time, by the index scan and by a worker's read of a long range.
BLOCK_SIZE = 8 << 20
#: Rows of each file whose values decide the columns' types.
SAMPLE_ROWS = 1000

_NL, _CR, _QUOTE = ord("\n"), ord("\r"), ord('"')
_BOM = codecs.BOM_UTF8


def _is_csv(key: str) -> bool:
    return key.lower().endswith(".csv")


def csv_delimiter(value: Any) -> str:
    """The ``delimiter`` option as one character; ConfigError otherwise."""
    text = str(value)
    text = {"\\t": "\t", "tab": "\t"}.get(text, text)
    if len(text) != 1 or text in ('"', "\n", "\r"):
        raise ConfigError(
            f"--data-options delimiter={value!r}: a CSV delimiter is one character other than a quote or "
            "a newline (\\t or tab for a tab)"
        )
    return text


ReadBytes = Callable[[int, int], bytes]


@dataclass
class _Scan:
    """The state of one file's index scan between blocks."""

    describe: str
    parity: int = 0  # '"' seen so far, mod 2: 1 inside a quoted field
    line: int = 1  # the line number at the start of the next block
    row_start: int = 0  # where the row being scanned starts
    row_line: int = 1  # its line
    header_end: int = -1  # the offset past the header row, once found
    header_line: int = 0
    rows: int = 0  # data rows so far
    end: int = 0  # the offset past the last data row
    blank_line: int = 0  # the first blank line after the last row (0: none)
    last_byte: int = 0

    def __post_init__(self) -> None:
        self.offsets: list[int] = []
        self.lines: list[int] = []

    def rows_found(self, starts: np.ndarray, ends: np.ndarray, lines: np.ndarray, blank: np.ndarray) -> None:
        """Take the rows ``[starts[i], ends[i])`` (``ends``: past the row's newline) starting on ``lines``,
        ``blank`` where a row is empty: the header, data rows (every stride-th indexed) and blank lines."""
        filled = np.flatnonzero(~blank)
        after = int(filled[-1]) + 1 if len(filled) else 0  # the blank rows from here on end the block
        if len(filled):
            blanks = np.flatnonzero(blank[: filled[-1]])
            if self.blank_line or len(blanks):
                line = self.blank_line or int(lines[blanks[0]])
                raise DataFormatError(
                    f"CSV file {self.describe} line {line}: a blank line between rows; remove it"
                )
            if self.header_end < 0:
                self.header_end, self.header_line = int(ends[filled[0]]), int(lines[filled[0]])
                filled = filled[1:]
            numbers = self.rows + np.arange(len(filled))
            picked = filled[numbers % INDEX_STRIDE == 0]
            self.offsets.extend(starts[picked].tolist())
            self.lines.extend(lines[picked].tolist())
            self.rows += len(filled)
            if len(filled):
                self.end = int(ends[filled[-1]])
        if after < len(blank) and not self.blank_line:
            self.blank_line = int(lines[after])

    def block(self, position: int, data: bytes) -> None:
        """Scan the block ``data`` found at ``position`` of the file."""
        array = np.frombuffer(data, dtype=np.uint8)
        newlines = np.flatnonzero(array == _NL)
        if data.find(b'"') < 0:  # the fast path: no quote, so every newline or none ends a row
            ending = np.arange(len(newlines)) if self.parity == 0 else np.empty(0, dtype=np.int64)
        else:
            inside = (np.cumsum(array == _QUOTE, dtype=np.uint8) + np.uint8(self.parity)) & 1
            ending = np.flatnonzero(inside[newlines] == 0)
            self.parity = int(inside[-1])
        if len(ending):
            ends_at = newlines[ending]  # each row's newline, in the block
            ends = ends_at.astype(np.int64) + position + 1
            starts = np.empty(len(ends), dtype=np.int64)
            starts[0] = self.row_start
            starts[1:] = ends[:-1]
            lines = np.empty(len(ends), dtype=np.int64)
            lines[0] = self.row_line
            lines[1:] = self.line + ending[:-1] + 1
            before = np.where(ends_at > 0, array[np.maximum(ends_at - 1, 0)], self.last_byte)
            length = ends - starts - 1  # without the newline
            blank = (length == 0) | ((length == 1) & (before == _CR))
            self.rows_found(starts, ends, lines, blank)
            self.row_start, self.row_line = int(ends[-1]), self.line + int(ending[-1]) + 1
        self.line += len(newlines)
        self.last_byte = data[-1]

    def finish(self, size: int) -> None:
        """The rest of the file after the last newline that ends a row: a last row without a newline."""
        if self.parity:
            raise DataFormatError(
                f"CSV file {self.describe} line {self.row_line}: a quoted field is not closed by the end of "
                'the file (a field that holds a " writes it as "")'
            )
        length = size - self.row_start
        if length > 0:
            blank = np.array([length == 1 and self.last_byte == _CR])
            one = np.array
            self.rows_found(one([self.row_start]), one([size]), one([self.row_line]), blank)


def index_csv(read: ReadBytes, size: int, describe: str) -> tuple[int, int, OffsetIndex]:
    """One streaming pass over a CSV file of ``size`` bytes, read by ``read(offset, length)`` in blocks
    of :data:`BLOCK_SIZE`: ``(offset past the header row, the header's line, the data rows' index)``.
    DataFormatError naming ``describe`` (the file) and the line for a file without a header or rows, a
    blank line between rows or an unclosed quote."""
    scan = _Scan(describe)
    position = 0
    while position < size:
        data = read(position, min(BLOCK_SIZE, size - position))
        if not data:
            break
        scan.block(position, data)
        position += len(data)
    scan.finish(position)
    if scan.header_end < 0:
        raise DataFormatError(f"CSV file {describe} is empty; it needs a header row and data rows")
    if not scan.rows:
        raise DataFormatError(f"CSV file {describe} has a header but no data rows")
    return scan.header_end, scan.header_line, OffsetIndex(scan.offsets, scan.rows, scan.end, scan.lines)


def _lines(read: ReadBytes, start: int, end: int, first_line: int, describe: str) -> Iterator[str]:
    """The lines of bytes ``[start, end)`` as text (line endings kept; a byte-order mark at the file's
    start dropped), read in blocks of :data:`BLOCK_SIZE`."""
    position, rest, line = start, b"", first_line
    bom = start == 0  # whether a byte-order mark may still come
    while position < end:
        data = read(position, min(BLOCK_SIZE, end - position))
        if not data:
            break
        position += len(data)
        data = rest + data
        if bom and len(data) < len(_BOM) and _BOM.startswith(data) and position < end:
            rest = data  # too little yet to tell
            continue
        if bom and data.startswith(_BOM):
            data = data[len(_BOM) :]
        bom = False
        parts = data.split(b"\n")
        rest = parts.pop()
        for part in parts:
            yield _decode(part + b"\n", line, describe)
            line += 1
    if rest:
        yield _decode(rest, line, describe)


def _decode(raw: bytes, line: int, describe: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataFormatError(f"CSV file {describe} line {line}: not UTF-8 ({error.reason})") from None


def read_rows(
    lines: Iterator[str], delimiter: str, first_line: int, skip: int, take: int, describe: str
) -> tuple[list[list[str]], list[int]]:
    """From the CSV ``lines`` (the first is line ``first_line`` of the file): skip ``skip`` rows, then
    ``(the next take rows' fields, the line each starts on)``. Blank rows are left out."""
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # a quoted field may be as large as the file
    reader = csv.reader(lines, delimiter=delimiter)
    rows: list[list[str]] = []
    starts: list[int] = []
    line = first_line
    try:
        for row in reader:
            if row:
                if skip:
                    skip -= 1
                else:
                    rows.append(row)
                    starts.append(line)
                    if len(rows) == take:
                        break
            line = first_line + reader.line_num
    except csv.Error as error:
        raise DataFormatError(f"CSV file {describe} line {line}: {error}") from None
    return rows, starts


def _column(
    rows: Sequence[Sequence[str]],
    starts: Sequence[int],
    index: int,
    fields: Sequence[str],
    column: Column,
    fill: str | None,
    describe: str,
) -> np.ndarray:
    """``fields`` (field ``index`` of every row) as an array of ``column``'s type; DataFormatError naming
    the file, line and column for a value that is not of it, or an empty numeric value without ``fill``."""
    if column.dtype == "string":
        values = np.empty(len(fields), dtype=object)
        values[:] = fields
        return values
    texts = [text.strip() or fill.strip() for text in fields] if fill is not None else fields
    fast = column_values(texts, column.dtype)
    if fast is not None:
        return fast
    fits, parse = PARSERS[column.dtype]  # value by value, to name the first that does not fit
    values = np.empty(len(rows), dtype=column.numpy_dtype)
    for i, row in enumerate(rows):
        text = row[index].strip()
        if not text:
            if fill is None:
                raise DataFormatError(
                    f"CSV file {describe} line {starts[i]}, column {column.name!r}: missing value; fill it, "
                    "or pass --data-options fill_missing=VALUE to stand for every missing value"
                )
            text = fill.strip()
        if not fits(text):
            raise DataFormatError(
                f"CSV file {describe} line {starts[i]}, column {column.name!r}: {row[index]!r} is not "
                f"{column.dtype}; fix the value, or give the column's type with --data-options "
                f"schema={column.name}:string"
            )
        values[i] = parse(text)
    return values


class CsvReader(RangeReader):
    """A worker's reader of CSV row ranges: one ranged read (in blocks for a long range) per task."""

    def __init__(self, spec: ReaderSpec) -> None:
        super().__init__(spec)
        self.files = PinnedFiles(spec.url)
        self.header: list[str] = [str(name) for name in spec.options["header"]]
        self.delimiter = csv_delimiter(spec.options.get("delimiter", ","))
        fill = spec.options.get("fill_missing")
        self.fill: str | None = None if fill is None else str(fill)
        self.indexes = [self.header.index(name) for name in spec.schema.names]

    def rows(
        self, shard: str, start: int, end: int, version: str = "", hint: str = ""
    ) -> tuple[list[list[str]], list[int]]:
        """The fields of rows ``[start, end)`` as text and the line each starts on; DataFormatError if the
        file does not have them, or a row has not the header's number of fields."""
        describe = self.files.describe(shard)
        if hint:
            located = RangeHint.from_str(hint)
            offset, skip, line = located.offset, located.skip, located.line
            stop = located.end_offset if located.end_offset >= 0 else self.files.size(shard, version)
        else:  # from the start of the file, past its header
            offset, skip, line = 0, start + 1, 1
            stop = self.files.size(shard, version)

        def read(position: int, length: int) -> bytes:
            return self.files.read(shard, position, length, version)

        lines = _lines(read, offset, stop, line, describe)
        rows, starts = read_rows(lines, self.delimiter, line, skip, end - start, describe)
        if len(rows) != end - start:
            raise DataFormatError(
                f"CSV file {describe}: rows [{start}, {end}) asked for, {len(rows)} found there; the file "
                "changed since the dataset was opened, or a quote inside an unquoted field confused its rows"
            )
        for row, row_line in zip(rows, starts, strict=True):
            if len(row) != len(self.header):
                raise DataFormatError(
                    f"CSV file {describe} line {row_line}: {len(row)} fields, "
                    f"the header has {len(self.header)}"
                )
        return rows, starts

    def read(self, shard: str, start: int, end: int, *, version: str = "", hint: str = "") -> Records:
        if start == end:
            return self.spec.schema.empty()
        if hint:
            located = RangeHint.from_str(hint)
            if located.offset > 0 and 0 <= located.end_offset - located.offset <= ARROW_BLOCK_LIMIT:
                block = self.files.read(shard, located.offset, located.end_offset - located.offset, version)
                parsed = self._arrow_rows(block, located.skip, end - start)
                if parsed is not None:
                    return parsed
        rows, starts = self.rows(shard, start, end, version, hint)
        describe = self.files.describe(shard)
        fields = list(zip(*rows, strict=True))  # one tuple per field (every row has them all)
        return tuple(
            _column(rows, starts, index, fields[index], column, self.fill, describe)
            for index, column in zip(self.indexes, self.spec.schema.columns, strict=True)
        )

    def _arrow_rows(self, block: bytes, skip: int, take: int) -> Records | None:
        """Rows ``[skip, skip + take)`` of ``block`` (whole rows, from a row's start) parsed by Arrow's CSV
        reader, ten times faster than Python's; None when the block is anything but clean data of the
        schema's types (a null, a NaN or infinity, a value Arrow refuses, another row count): the caller
        then parses it in Python, which accepts exactly the documented forms and names what is wrong."""
        import pyarrow as pa
        from pyarrow import csv as arrow_csv

        schema = self.spec.schema
        try:
            table = arrow_csv.read_csv(
                pa.py_buffer(block),
                read_options=arrow_csv.ReadOptions(column_names=self.header, use_threads=False),
                parse_options=arrow_csv.ParseOptions(delimiter=self.delimiter, newlines_in_values=True),
                convert_options=arrow_csv.ConvertOptions(
                    include_columns=list(schema.names),
                    column_types={c.name: _ARROW_TYPES[c.dtype] for c in schema.columns},
                    strings_can_be_null=False,
                    quoted_strings_can_be_null=False,
                ),
            )
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None
        if table.num_rows < skip + take:
            return None
        table = table.slice(skip, take)
        columns = []
        for column, values in zip(schema.columns, table.columns, strict=True):
            if values.null_count:
                return None
            array = values.to_numpy(zero_copy_only=False)
            if column.dtype.startswith("float") and not np.all(np.isfinite(array)):
                return None
            columns.append(array.astype(column.numpy_dtype))
        return tuple(columns)


#: The largest range (bytes) a worker parses with Arrow at once; a longer one streams through Python's csv.
ARROW_BLOCK_LIMIT = 256 << 20


def _arrow_type(dtype: str) -> Any:
    """What Arrow parses a column of ``dtype`` as: float32 as float64, then cast, as the Python path does
    (parsing straight to float32 could round a value differently)."""
    import pyarrow as pa

    parsed = {"string": pa.string(), "bool": pa.bool_(), "float32": pa.float64()}
    return parsed.get(dtype) or pa.from_numpy_dtype(np.dtype(dtype))


class _ArrowTypes(dict):  # type: ignore[type-arg]
    """Column type -> its Arrow type, made on first use (pyarrow is imported only when parsing)."""

    def __missing__(self, dtype: str) -> Any:
        self[dtype] = _arrow_type(dtype)
        return self[dtype]


_ARROW_TYPES = _ArrowTypes()


class OpenedCsv(OpenedDataset):
    """CSV files opened for planning: each file's sparse row index, kept here for :meth:`locate`."""

    def __init__(
        self, spec: ReaderSpec, shards: Sequence[ShardInfo], indexes: dict[str, OffsetIndex]
    ) -> None:
        reader = CsvReader(spec)
        super().__init__(spec, shards, reader)
        self.indexes = indexes
        self._files = reader.files

    def describe(self, shard: str = "") -> str:
        return self._files.describe(shard) if shard else self.spec.url

    def locate(self, shard: str, start: int, end: int) -> str:
        return self.indexes[shard].locate(start, end).to_str()


def check_header(describe: str, header: Sequence[str]) -> None:
    """DataFormatError naming the CSV file ``describe`` for a column without a name or a name used
    twice."""
    for number, name in enumerate(header, start=1):
        if not name:
            raise DataFormatError(f"CSV file {describe} line 1: column {number} has no name")
    duplicates = sorted({name for name in header if header.count(name) > 1})
    if duplicates:
        raise DataFormatError(
            f"CSV file {describe} line 1: duplicate column names {', '.join(map(repr, duplicates))}; "
            "every column needs its own name"
        )


def _given_types(value: Any, header: list[str], url: str) -> dict[str, str]:
    """The ``schema`` option (``name:type,...`` or a JSON object) as name -> type."""
    if isinstance(value, dict):
        pairs = [(str(k), str(v)) for k, v in value.items()]
    else:
        pairs = []
        for item in list_option(value):
            name, sep, kind = item.rpartition(":")
            if not sep:
                raise ConfigError(f"--data-options schema item {item!r} is not name:type")
            pairs.append((name.strip(), kind.strip()))
    for name, kind in pairs:
        if name not in header:
            raise ConfigError(
                f"--data-options schema: {name!r} is not a column of {url}; columns: {', '.join(header)}"
            )
        if kind not in COLUMN_TYPES:
            raise ConfigError(
                f"--data-options schema: type {kind!r} of column {name!r} is not one of "
                f"{', '.join(COLUMN_TYPES)}"
            )
    return dict(pairs)


class CsvFormat(DataFormat):
    name = "csv"
    options = ("delimiter", "columns", "schema", "fill_missing")

    def open(self, url: str, options: dict[str, Any], what: str = "") -> OpenedDataset:
        delimiter = csv_delimiter(options.get("delimiter", ","))
        fill = None if options.get("fill_missing") is None else str(options["fill_missing"])
        listing = list_data_files(url, _is_csv, what, self.name)
        files = PinnedFiles(listing.folder_url)
        header: list[str] = []
        samples: list[list[str]] = []
        indexes: dict[str, OffsetIndex] = {}
        for info in listing.files:
            describe = files.describe(info.key)

            def read(position: int, length: int, key: str = info.key, version: str = info.version) -> bytes:
                return files.read(key, position, length, version)

            header_end, header_line, index = index_csv(read, info.size, describe)
            lines = _lines(read, 0, header_end, 1, describe)
            found = read_rows(lines, delimiter, 1, 0, 1, describe)[0][0]
            if not header:
                check_header(describe, found)
                header = found
            elif found != header:
                raise DataFormatError(
                    f"CSV file {describe} line {header_line}: header {','.join(found)!r} differs from "
                    f"{','.join(header)!r} of {files.describe(listing.files[0].key)}; every file of a "
                    "dataset needs the same columns"
                )
            indexes[info.key] = index
            sample = index.locate(0, min(SAMPLE_ROWS, index.records))
            lines = _lines(read, sample.offset, sample.end_offset, sample.line, describe)
            samples.extend(read_rows(lines, delimiter, sample.line, 0, SAMPLE_ROWS, describe)[0])
        given = _given_types(options["schema"], header, url) if options.get("schema") else {}
        columns = list_option(options["columns"]) if options.get("columns") else header
        for name in columns:
            if name not in header:
                raise ConfigError(
                    f"--data-options columns: {name!r} is not a column of {url}; columns: {', '.join(header)}"
                )
        schema = RecordSchema(
            tuple(
                Column(name, given.get(name) or _infer(samples, header.index(name), fill)) for name in columns
            )
        )
        spec_options: dict[str, Any] = {"delimiter": delimiter, "header": header}
        if fill is not None:
            spec_options["fill_missing"] = fill
        spec = ReaderSpec(self.name, listing.folder_url, schema, spec_options)
        shards = [ShardInfo(info.key, indexes[info.key].records, info.version) for info in listing.files]
        return OpenedCsv(spec, shards, indexes)

    def range_reader(self, spec: ReaderSpec) -> RangeReader:
        return CsvReader(spec)

    def detect(self, url: str, names: Sequence[str]) -> bool:
        return any(_is_csv(name) for name in names)


def _infer(rows: Sequence[Sequence[str]], index: int, fill: str | None) -> str:
    """The type of field ``index`` of the sample ``rows``: empty values count as ``fill``, or not at all."""
    values = (row[index].strip() if index < len(row) else "" for row in rows)
    return infer_type(value for value in (v or (fill or "").strip() for v in values) if value)
