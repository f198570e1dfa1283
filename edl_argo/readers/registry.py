"""The data formats by name, how a dataset's format is found, and opening a dataset of any format.

A format's module is imported only when it is used (Parquet needs ``pyarrow``, SQL ``sqlalchemy``).
"""

from __future__ import annotations

import importlib
import json
import re
from functools import cache
from typing import Any

from edl_argo.errors import ConfigError, DataFormatError, StorageError
from edl_argo.readers.base import DataFormat, OpenedDataset, RangeReader, ReaderSpec

#: ``--data-format`` name -> ``module:class`` of its :class:`DataFormat`, in detection order.
FORMATS: dict[str, str] = {
    "recordio": "edl_argo.readers.recordio:RecordIOFormat",
    "tfrecord": "edl_argo.readers.tfrecord:TFRecordFormat",
    "csv": "edl_argo.readers.csv_files:CsvFormat",
    "parquet": "edl_argo.readers.parquet_files:ParquetFormat",
    "images": "edl_argo.readers.images:ImageFolderFormat",
    "sql": "edl_argo.readers.sql:SqlFormat",
    "custom": "edl_argo.readers.custom:CustomFormat",
}
#: Formats that detection never picks: a database URL says SQL, a model's data reader says custom.
NOT_DETECTED = ("sql", "custom")

#: URL schemes (before any ``+driver``) that name a database rather than storage.
SQL_SCHEMES = ("sqlite", "postgresql", "postgres", "mysql", "mariadb")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9.-]*)(\+[A-Za-z0-9_]+)?://")
#: How many object names detection looks at.
DETECT_SAMPLE = 1000


@cache
def data_format(name: str) -> DataFormat:
    """The format ``name``; ConfigError listing the known ones."""
    if name not in FORMATS:
        raise ConfigError(f"--data-format {name!r} is not one of {', '.join(FORMATS)}")
    module, _, cls = FORMATS[name].partition(":")
    return getattr(importlib.import_module(module), cls)()


def is_sql_url(url: str) -> bool:
    match = _SCHEME.match(url.strip())
    return bool(match) and match.group(1).lower() in SQL_SCHEMES


def detect_format(url: str, what: str = "") -> str:
    """The format of the dataset at ``url``: SQL for a database URL; for storage, the one a manifest names
    (``data_format``, RecordIO by default), else the one format whose files are there, else RecordIO (whose
    reader then says what a dataset there lacks). ConfigError naming ``url`` if several formats match."""
    from edl_argo.recordio import MANIFEST_NAME
    from edl_argo.storage import open_storage

    label = f"{what} {url}" if what else url
    if is_sql_url(url):
        return "sql"
    storage = open_storage(url)
    try:
        names = [info.key for info in storage.list("")[:DETECT_SAMPLE]]
    except StorageError:
        names = []
    if not names:  # one file, or nothing
        names = [url.rstrip("/").rpartition("/")[2]]
    if MANIFEST_NAME in names:
        try:
            return str(json.loads(storage.read(MANIFEST_NAME)).get("data_format", "recordio"))
        except (ValueError, AttributeError):
            return "recordio"  # the RecordIO reader names what is wrong with it
    visible = [n for n in names if not any(part[:1] in (".", "_") for part in n.split("/"))]
    if not visible:  # nothing there, or only what a killed writer left: RecordIO names what is missing
        return "recordio"
    found = [name for name in FORMATS if name not in NOT_DETECTED and data_format(name).detect(url, visible)]
    if len(found) == 1:
        return found[0]
    if not found:  # RecordIO, the default, names what a dataset there lacks (its manifest)
        return "recordio"
    raise ConfigError(f"{label}: files of several formats there ({', '.join(found)}); pass --data-format")


def parse_data_options(text: str) -> dict[str, Any]:
    """``--data-options "k=v;k=v"`` as a dict of strings; ConfigError for an item without ``=``."""
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--data-options item {item!r} is not key=value (items are separated by ';')")
        options[key.strip()] = value.strip()
    return options


def open_data(
    url: str, fmt: str = "", options: dict[str, Any] | None = None, what: str = ""
) -> OpenedDataset:
    """Open the dataset at ``url`` in format ``fmt`` (detected if empty) for planning."""
    name = fmt or detect_format(url, what)
    chosen = data_format(name)
    if chosen.options is not None:
        unknown = sorted(set(options or {}) - set(chosen.options))
        if unknown:
            accepted = ", ".join(chosen.options) or "none"
            raise ConfigError(
                f"--data-options {', '.join(unknown)}: not an option of {name} data (it takes: {accepted})"
            )
    try:
        return chosen.open(url, dict(options or {}), what)
    except (ConfigError, DataFormatError, StorageError):
        raise
    except (OSError, ValueError) as error:
        label = f"{what} {url}" if what else url
        raise DataFormatError(f"{label}: not readable as {name}: {error}") from None


def range_reader(spec: ReaderSpec) -> RangeReader:
    """A worker's reader of the dataset ``spec`` describes."""
    return data_format(spec.format).range_reader(spec)


def worker_spec_json(data: OpenedDataset) -> str:
    """``data``'s reader spec as tasks and worker flags carry it; empty for RecordIO, a worker's default
    (:func:`spec_from_json`), so a RecordIO job's tasks and pod commands stay as they were."""
    return "" if data.format == "recordio" else data.spec.to_json()


def spec_from_json(text: str, data_url: str) -> ReaderSpec:
    """The spec a task or flag carries; a RecordIO dataset at ``data_url`` when empty."""
    return ReaderSpec.from_json(text) if text else ReaderSpec("recordio", data_url)
