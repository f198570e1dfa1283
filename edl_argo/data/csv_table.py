"""A CSV file as ``tf.train.Example`` records, streamed: memory does not grow with the file.

:func:`scan_csv` reads the file once and decides each column's type; :func:`csv_examples` reads it again
and yields one record per row. Neither holds more than one row.

Rules (``edl-argo data convert``; documented in docs/user-guide.md, "Data and storage"):

* The first line is the header. A UTF-8 byte-order mark is dropped; blank lines at the end are ignored, a
  blank line between rows is an error. Quoted fields may hold commas, newlines and any amount of text.
* Column names must be non-empty and unique, and no feature may be named ``label`` (the label column's
  values are stored under that name).
* A column is int64 when every value is an integer in int64's range (optional sign, ASCII digits), else
  float32 when every value is a decimal number that float32 holds (``1.5``, ``-2e3``, ``.25``), else text
  (bytes). ``nan``, ``inf``, ``1_000`` or ``0x10`` are not numbers. Surrounding spaces are ignored for
  numbers.
* An empty value is missing: refused with its line and column, unless a fill value is given
  (``--fill-missing VALUE``), which then stands for it before types are decided.
* Every error names the file and the line of the file (not the row: quoted newlines count).
"""

from __future__ import annotations

import codecs
import csv
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from edl_argo.errors import ConfigError, DataFormatError
from edl_argo.proto import example_pb2
from edl_argo.readers.csv_files import check_header
from edl_argo.readers.text_values import fits_float32, fits_int64

#: The feature name under which the label column's values are stored.
LABEL_FEATURE = "label"

INT64, FLOAT32, TEXT = "int64", "float32", "bytes"


@dataclass(frozen=True)
class CsvSchema:
    """What the first pass found: the header, each column's type and the number of data rows."""

    path: Path
    header: tuple[str, ...]
    types: tuple[str, ...]
    rows: int
    label_column: str
    fill_missing: str | None

    def describe(self) -> str:
        """``name type`` of every column, for the command's summary."""
        return ", ".join(f"{name} {kind}" for name, kind in zip(self.header, self.types, strict=True))


def _rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """``(line of the file where the row starts, fields)`` of every non-blank row, header included."""
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # a quoted field may be as large as the file
    line, blank_at = 1, 0
    try:
        with path.open("rb") as handle:
            reader = csv.reader(_decoded_lines(path, handle))
            try:
                for row in reader:
                    if not row:
                        blank_at = blank_at or line
                    elif blank_at:
                        raise DataFormatError(f"CSV file {path} line {blank_at}: a blank line between rows")
                    else:
                        yield line, row
                    line = reader.line_num + 1
            except csv.Error as error:
                raise DataFormatError(f"CSV file {path} line {reader.line_num}: {error}") from None
    except OSError as error:
        raise ConfigError(f"cannot read CSV file {path}: {error.strerror or error}") from None


def _decoded_lines(path: Path, handle: BinaryIO) -> Iterator[str]:
    """The file's lines as text (line endings kept, a leading UTF-8 byte-order mark dropped)."""
    for number, raw in enumerate(handle, start=1):
        if number == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8) :]
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise DataFormatError(f"CSV file {path} line {number}: not UTF-8 ({error.reason})") from None


def _check_header(path: Path, header: list[str], label_column: str) -> None:
    check_header(str(path), header)
    if label_column not in header:
        raise ConfigError(
            f"--label-column {label_column!r} is not a column of {path}; columns: {', '.join(header)}"
        )
    if label_column != LABEL_FEATURE and LABEL_FEATURE in header:
        raise DataFormatError(
            f"CSV file {path}: column {LABEL_FEATURE!r} clashes with the label, which records store as "
            f"{LABEL_FEATURE!r}; rename that column (or pass it as --label-column)"
        )


def _value(path: Path, line: int, name: str, raw: str, fill_missing: str | None) -> str:
    if raw.strip():
        return raw
    if fill_missing is None:
        raise DataFormatError(
            f"CSV file {path} line {line}, column {name!r}: missing value; fill it, or pass "
            "--fill-missing VALUE to stand for every missing value"
        )
    return fill_missing


def scan_csv(path: Path, label_column: str, fill_missing: str | None = None) -> CsvSchema:
    """First pass: check the header and every row, decide the columns' types, count the rows."""
    rows = _rows(path)
    first = next(rows, None)
    if first is None:
        raise DataFormatError(f"CSV file {path} is empty; it needs a header row and data rows")
    header = first[1]
    _check_header(path, header, label_column)
    could_be_int = [True] * len(header)
    could_be_float = [True] * len(header)
    count = 0
    for line, row in rows:
        if len(row) != len(header):
            raise DataFormatError(
                f"CSV file {path} line {line}: {len(row)} fields, the header has {len(header)}"
            )
        for column, raw in enumerate(row):
            if not could_be_float[column]:
                if not raw.strip() and fill_missing is None:
                    _value(path, line, header[column], raw, fill_missing)
                continue
            text = _value(path, line, header[column], raw, fill_missing).strip()
            if could_be_int[column] and not fits_int64(text):
                could_be_int[column] = False
            if not could_be_int[column] and not fits_float32(text):
                could_be_float[column] = False
        count += 1
    if not count:
        raise DataFormatError(f"CSV file {path} has a header but no data rows")
    types = tuple(
        INT64 if is_int else FLOAT32 if is_float else TEXT
        for is_int, is_float in zip(could_be_int, could_be_float, strict=True)
    )
    return CsvSchema(path, tuple(header), types, count, label_column, fill_missing)


def csv_examples(schema: CsvSchema) -> Iterator[bytes]:
    """Second pass: one serialized ``tf.train.Example`` per row, features in column order with the label
    (stored as ``label``) last. DataFormatError if the file changed since :func:`scan_csv`."""
    order = [i for i, name in enumerate(schema.header) if name != schema.label_column]
    order.append(schema.header.index(schema.label_column))
    names = [LABEL_FEATURE if schema.header[i] == schema.label_column else schema.header[i] for i in order]
    fill = schema.fill_missing
    count = 0
    rows = _rows(schema.path)
    next(rows)  # the header
    for line, row in rows:
        if len(row) != len(schema.header) or count >= schema.rows:
            raise DataFormatError(
                f"CSV file {schema.path} line {line}: the file changed while it was converted"
            )
        example = example_pb2.Example()
        features = example.features.feature
        for name, column in zip(names, order, strict=True):
            raw = row[column] if row[column].strip() or fill is None else fill
            kind = schema.types[column]
            try:
                if kind == INT64:
                    features[name].int64_list.value.append(int(raw))
                elif kind == FLOAT32:
                    features[name].float_list.value.append(float(raw))
                else:
                    features[name].bytes_list.value.append(raw.encode())
            except ValueError:
                raise _changed(schema.path, line) from None
        count += 1
        yield example.SerializeToString()
    if count != schema.rows:
        raise _changed(schema.path, line=0)


def _changed(path: Path, line: int) -> DataFormatError:
    where = f" line {line}" if line else ""
    return DataFormatError(
        f"CSV file {path}{where}: the file changed while it was converted; convert it again"
    )
