"""SQL tables and queries (SQLite, PostgreSQL, MySQL/MariaDB through SQLAlchemy) as datasets.

A dataset URL is a SQLAlchemy database URL with the table, or a query, in its fragment::

    postgresql://postgres@db:5432/test#census
    postgresql://postgres@db:5432/test#SELECT age, income FROM census WHERE age > 20

The fragment is taken verbatim (not URL-decoded); one starting with ``SELECT`` or ``WITH`` is a query,
anything else a table name (``table`` or ``schema.table``). The URL never carries a password (one that does
is a ConfigError): the password is the environment variable ``EDL_DB_PASSWORD`` if set (a Kubernetes Secret
in pods), added to the connection only, so it is never logged nor sent with a task. A URL without a driver
gets the one installed with edl-argo (``postgresql+psycopg2``, ``mysql+pymysql``).

Options (``--data-options "k=v;k=v"``):

- ``key``: a unique, orderable, non-NULL column (an auto-increment id). Reads then cost O(range): the master
  pins ``max(key)`` and the row count at open (rows added later, with a greater key, are never read) and keeps
  a sparse index, the key of every :data:`INDEX_STRIDE`-th row in key order; a worker reads
  ``WHERE key >= :lo AND key <= :max ORDER BY key LIMIT :n`` from the index entry before its range and skips
  fewer than :data:`INDEX_STRIDE` rows. Rows inserted with a key below the pinned maximum, or deleted, shift
  the ranges: the snapshot assumes an append-only table (a read that finds its block's first key gone or too
  few rows fails with ShardChangedError).
- Without ``key`` the rows are ordered by all selected columns and a range is ``LIMIT :n OFFSET :start`` of
  that order, which the database pays O(offset + range) for (a sort of the whole result per read). The row
  count is pinned at open; every read counts the rows again (in the same statement) and a different count
  is a ShardChangedError naming the table.
- ``columns``: ``a,b`` reads only those columns (default: all of the table or query).
- ``fill_missing``: ``true`` reads a NULL as 0, 0.0, false or "" (default: a NULL is a DataFormatError naming
  the table, column and row key).
- ``connect_timeout`` (seconds, default 10) and ``statement_timeout`` (seconds, default 600): no call to the
  database is without a deadline. PostgreSQL gets a server ``statement_timeout``, MySQL/MariaDB a socket read
  timeout, SQLite a progress handler that interrupts a statement past its deadline.

The whole result is one shard, ``"0"``: the master cuts it into tasks by record range like any shard, and a
database serves any range directly, so more shards would buy nothing. Its version is
``max=<json key>;rows=<n>`` with a key, ``rows=<n>`` without.

Column types come from the values of the first :data:`SCHEMA_SAMPLE` rows (SQLite has no column types, and
a query's result types are the driver's own): integers are ``int64``, floats and decimals ``float64``,
booleans ``bool``, text ``string``; anything else (dates, bytes, JSON) is a ConfigError naming the column and
its type: cast it in a query.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, Connection, Engine, make_url

from edl_argo.errors import ConfigError, DataFormatError, StorageError
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
from edl_argo.readers.credentials import PASSWORD_ENV
from edl_argo.recordio.reader import ShardChangedError

#: The environment variable holding the database password (never part of a URL).
#: The key of the index kept for every ``INDEX_STRIDE``-th row: a read skips fewer rows than this.
INDEX_STRIDE = 64
#: How many rows open() looks at to infer the column types.
SCHEMA_SAMPLE = 1000
#: The one shard of a SQL dataset.
SHARD = "0"
#: The databases whose drivers are installed with edl-argo, as errors list them.
INSTALLED_DATABASES = "sqlite, postgresql (psycopg2), mysql and mariadb (pymysql)"
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_STATEMENT_TIMEOUT = 600.0
_OPTIONS = ("key", "columns", "fill_missing", "connect_timeout", "statement_timeout")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]*$")
_QUERY = re.compile(r"^\s*(SELECT|WITH)\b", re.IGNORECASE)
_FILL = {"string": "", "int64": 0, "int32": 0, "float64": 0.0, "float32": 0.0, "bool": False}


@dataclass(frozen=True)
class SqlSource:
    """A dataset URL taken apart: the database URL (no password) and the table or query it names."""

    url: str
    database: str
    table: str = ""
    query: str = ""

    @property
    def name(self) -> str:
        """The table, or the query, for messages."""
        return self.table or self.query

    @classmethod
    def parse(cls, url: str, what: str = "") -> SqlSource:
        """``url`` split at its ``#``; ConfigError for a missing fragment, a bad table name or a password."""
        label = f"{what} {url}" if what else url
        database, sep, fragment = url.partition("#")
        fragment = fragment.strip()
        if not sep or not fragment:
            raise ConfigError(
                f"{label}: a SQL dataset URL names its table or query after '#' (db-url#table or "
                "db-url#SELECT ...)"
            )
        parse_database(database, what)
        if _QUERY.match(fragment):
            return cls(url, database, query=fragment.rstrip(";").strip())
        parts = fragment.split(".")
        if len(parts) > 2 or not all(_IDENTIFIER.match(part) for part in parts):
            raise ConfigError(
                f"{label}: {fragment!r} is neither a table name (name or schema.name) nor a query "
                "(SELECT ... or WITH ...)"
            )
        return cls(url, database, table=fragment)


def parse_database(database: str, what: str = "") -> URL:
    """``database`` as a SQLAlchemy URL; ConfigError naming it (after ``what``, the flag or clause that gave
    it) if it is not a URL or carries a password (shown hidden)."""
    try:
        parsed = make_url(database)
    except (sa_exc.ArgumentError, ValueError) as error:
        label = f"{what} {database}" if what else database
        raise ConfigError(f"{label}: not a database URL: {_first_line(error)}") from None
    if parsed.password is not None:
        raise ConfigError(
            f"{what + ' ' if what else ''}{parsed.render_as_string(hide_password=True)}: a database URL "
            f"must not carry a password; set the environment variable {PASSWORD_ENV} (--db-secret in pods)"
        )
    return parsed


def _first_line(error: BaseException) -> str:
    """The database's own message's first line (the driver's, without SQLAlchemy's decorations)."""
    orig = getattr(error, "orig", None) or error
    args = getattr(orig, "args", ())
    text = str(args[1]) if len(args) == 2 and isinstance(args[0], int) else str(orig)  # pymysql: (code, msg)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else type(orig).__name__


def _seconds(options: dict[str, Any], name: str, default: float) -> float:
    try:
        value = float(options.get(name, default))
    except (TypeError, ValueError):
        raise ConfigError(f"--data-options {name}={options.get(name)!r} is not a number of seconds") from None
    if not value > 0 or math.isinf(value):
        raise ConfigError(f"--data-options {name}={options.get(name)!r} must be a positive number of seconds")
    return value


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def database_url(database: str) -> URL:
    """``database`` as a SQLAlchemy URL with the installed driver and the password from the environment."""
    url = make_url(database)
    backend, _, driver = url.drivername.partition("+")
    backend = "postgresql" if backend == "postgres" else backend
    if not driver and backend == "postgresql":
        driver = "psycopg2"
    elif not driver and backend in ("mysql", "mariadb"):
        driver = "pymysql"
    url = url.set(drivername=f"{backend}+{driver}" if driver else backend)
    password = os.environ.get(PASSWORD_ENV)
    return url.set(password=password) if password else url


_ENGINES: dict[tuple[str, str, float, float], Engine] = {}
_ENGINES_LOCK = threading.Lock()


def engine_for(
    database: str, connect_timeout: float, statement_timeout: float, label: str = "", create: bool = False
) -> Engine:
    """One engine per database URL and timeouts in this process (a worker reads every task through it):
    ``pool_pre_ping`` drops connections the server closed, and every call has a deadline.

    Every engine of edl-argo is made here, for a ``database`` :func:`parse_database` accepted. One whose
    dialect or driver this installation lacks is a ConfigError starting with ``label`` (default: the URL;
    e.g. ``--db URL``, the flag that gave it). Nothing connects before the first statement. A SQLite
    database file must be there (SQLite would make an empty one on connecting) unless ``create``, for a
    command that writes a new database: ConfigError ``no SQLite database at PATH`` otherwise."""
    password = os.environ.get(PASSWORD_ENV, "")
    cache_key = (database, password, connect_timeout, statement_timeout)
    with _ENGINES_LOCK:
        engine = _ENGINES.get(cache_key)
        if engine is None:
            engine = _ENGINES[cache_key] = _new_engine(database, connect_timeout, statement_timeout, label)
    if not create:
        _require_sqlite_file(engine.url, label or database)
    return engine


def _require_sqlite_file(url: URL, label: str) -> None:
    """ConfigError naming ``label`` if ``url`` is a SQLite database file that is not there (an in-memory
    database, or a ``file:`` URI, which may say ``mode=ro``, is let through)."""
    path = url.database or ""
    if url.get_backend_name() != "sqlite" or path in ("", ":memory:") or path.startswith("file:"):
        return
    if not Path(path).is_file():
        raise ConfigError(f"{label}: no SQLite database at {path}")


def _new_engine(database: str, connect_timeout: float, statement_timeout: float, label: str) -> Engine:
    """The engine of :func:`engine_for`, with the connection arguments that give every call a deadline."""
    url = database_url(database)
    backend = url.get_backend_name()
    connect_args: dict[str, Any] = {}
    if backend == "postgresql":
        connect_args = {
            "connect_timeout": max(1, math.ceil(connect_timeout)),
            "options": f"-c statement_timeout={int(statement_timeout * 1000)}",
        }
    elif backend in ("mysql", "mariadb"):
        connect_args = {
            "connect_timeout": max(1, math.ceil(connect_timeout)),
            "read_timeout": max(1, math.ceil(statement_timeout)),
            "write_timeout": max(1, math.ceil(statement_timeout)),
        }
    elif backend == "sqlite":
        connect_args = {"timeout": connect_timeout}
    engine = _create_engine(url, connect_args, label or database)
    if backend == "sqlite":
        _sqlite_deadline(engine, statement_timeout)
    return engine


def _create_engine(url: URL, connect_args: dict[str, Any], label: str) -> Engine:
    """``sa.create_engine`` (which loads the dialect and imports its driver); ConfigError naming ``label``
    for a dialect SQLAlchemy does not know or a driver that is not installed."""
    try:
        return sa.create_engine(url, pool_pre_ping=True, connect_args=connect_args)
    except sa_exc.NoSuchModuleError:
        raise ConfigError(
            f"{label}: unsupported database dialect {url.drivername!r} (edl-argo reads {INSTALLED_DATABASES})"
        ) from None
    except ImportError as error:
        raise ConfigError(
            f"{label}: the driver of {url.drivername!r} is not installed ({error}); edl-argo reads "
            f"{INSTALLED_DATABASES}"
        ) from None


def _sqlite_deadline(engine: Engine, seconds: float) -> None:
    """Interrupt a SQLite statement running longer than ``seconds`` (SQLite has no statement timeout)."""

    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, record: Any) -> None:
        deadline = [math.inf]
        record.info["edl_deadline"] = deadline
        dbapi_connection.set_progress_handler(lambda: int(time.monotonic() > deadline[0]), 10000)

    @sa.event.listens_for(engine, "before_cursor_execute")
    def _start(conn: Connection, *_args: Any) -> None:
        deadline = conn.connection.info.get("edl_deadline")
        if deadline is not None:
            deadline[0] = time.monotonic() + seconds


class SqlTable:
    """The statements of one dataset (its table or query, projected columns and key), run through one
    engine, with database errors turned into one-line messages naming the URL."""

    def __init__(self, source: SqlSource, options: dict[str, Any], what: str = "") -> None:
        self.source = source
        self.what = what
        self.key = str(options.get("key", "")).strip()
        self.columns = [c.strip() for c in str(options.get("columns", "")).split(",") if c.strip()]
        self.fill_missing = _truthy(options.get("fill_missing", "false"))
        for name in [self.key, *self.columns]:
            if name and not _IDENTIFIER.match(name):
                raise ConfigError(f"{self.label}: column {name!r} is not a plain column name")
        self.engine = engine_for(
            source.database,
            _seconds(options, "connect_timeout", DEFAULT_CONNECT_TIMEOUT),
            _seconds(options, "statement_timeout", DEFAULT_STATEMENT_TIMEOUT),
            self.label,
        )
        self._quote = self.engine.dialect.identifier_preparer.quote

    @property
    def label(self) -> str:
        return f"{self.what} {self.source.url}" if self.what else self.source.url

    @property
    def described(self) -> str:
        """The table (or the query) and its database, for data errors."""
        return f"{self.source.database}#{self.source.name}"

    def quoted(self, name: str) -> str:
        return self._quote(name)

    @property
    def relation(self) -> str:
        """What ``FROM`` reads: the quoted table, or the query as a derived table."""
        if self.source.table:
            return ".".join(self.quoted(part) for part in self.source.table.split("."))
        return f"({self.source.query}) AS edl_source"

    def projection(self, names: Sequence[str] | None = None) -> str:
        chosen = list(names) if names is not None else self.columns
        return ", ".join(self.quoted(name) for name in chosen) if chosen else "*"

    @contextmanager
    def connect(self, failure: type[Exception] = ConfigError) -> Iterator[Connection]:
        """A connection; a database error inside is ``failure`` naming the URL and the database's message."""
        try:
            with self.engine.connect() as connection:
                yield connection
        except sa_exc.DBAPIError as error:
            if failure is ConfigError:
                raise ConfigError(f"{self.label}: {_first_line(error)}") from None
            if isinstance(error, sa_exc.OperationalError) and error.connection_invalidated:
                raise StorageError(f"{self.described}: {_first_line(error)}") from None
            raise failure(f"{self.described}: {_first_line(error)}") from None


def _infer(name: str, values: Sequence[Any], label: str) -> str:
    """The schema type of a column from its sampled values (NULLs left out)."""
    kinds = {type(value) for value in values if value is not None}
    if not kinds:
        raise ConfigError(
            f"{label}: column {name!r} is NULL in all of the first {SCHEMA_SAMPLE} rows; its type cannot be "
            "told: cast it or leave it out (--data-options columns=...)"
        )
    if kinds <= {bool}:
        return "bool"
    if kinds <= {int, bool}:
        return "int64"
    if kinds <= {int, float, Decimal}:
        return "float64"
    if kinds <= {str}:
        return "string"
    other = sorted(kind.__name__ for kind in kinds - {int, float, Decimal, str, bool})
    raise ConfigError(
        f"{label}: column {name!r} has values of type {', '.join(other) or 'mixed'}, not a number, boolean "
        "or text: cast it in a query (db-url#SELECT CAST(...) AS ...)"
    )


def _json_key(value: Any, label: str, key: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, str, float, Decimal)):
        raise ConfigError(f"{label}: key column {key!r} must be an integer or text column, not {type(value)}")
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    return value


def _version(max_key: Any, rows: int) -> str:
    return f"max={json.dumps(max_key)};rows={rows}" if max_key is not None else f"rows={rows}"


def _parse_version(version: str) -> tuple[Any, int | None]:
    """(pinned max key or None, pinned row count or None) of a version string."""
    if not version:
        return None, None
    head, _, rows = version.rpartition("rows=")
    max_key = json.loads(head[len("max=") : -1]) if head.startswith("max=") else None
    return max_key, int(rows)


class SqlReader(RangeReader):
    """A worker's reads of record ranges of a SQL dataset, through one engine per database URL."""

    def __init__(self, spec: ReaderSpec, what: str = "") -> None:
        super().__init__(spec)
        self.table = SqlTable(SqlSource.parse(spec.url, what), spec.options, what)

    def read(self, shard: str, start: int, end: int, *, version: str = "", hint: str = "") -> Records:
        if shard != SHARD:
            raise DataFormatError(f"{self.table.described}: no shard {shard!r} (a SQL dataset has one, '0')")
        if end <= start:
            return self.spec.schema.empty()
        pinned_max, pinned_rows = _parse_version(version)
        if self.table.key:
            rows, keys = self._read_keyed(start, end, pinned_max, hint)
        else:
            rows, keys = self._read_ordered(start, end, pinned_rows, version)
        if len(rows) != end - start:
            raise ShardChangedError(self.table.described, version or "any", f"{len(rows)} rows left")
        return self._arrays(rows, keys)

    def _read_keyed(
        self, start: int, end: int, pinned_max: Any, hint: str
    ) -> tuple[list[Sequence[Any]], list[Any]]:
        table = self.table
        key = table.quoted(table.key)
        with table.connect(DataFormatError) as connection:
            if hint:
                lo, skip, pinned_max = json.loads(hint)
            else:  # find the range's first key: O(start)
                bound = "" if pinned_max is None else f" WHERE {key} <= :max"
                lo = connection.execute(
                    sa.text(
                        f"SELECT {key} FROM {table.relation}{bound} ORDER BY {key} LIMIT 1 OFFSET :start"
                    ),
                    {"start": start, "max": pinned_max},
                ).scalar()
                skip = 0
                if lo is None:
                    return [], []
            bound = "" if pinned_max is None else f" AND {key} <= :max"
            statement = sa.text(
                f"SELECT {table.projection(self.spec.schema.names)}, {key} AS edl_key FROM {table.relation} "
                f"WHERE {key} >= :lo{bound} ORDER BY {key} LIMIT :n"
            )
            result = connection.execute(statement, {"lo": lo, "max": pinned_max, "n": skip + end - start})
            rows = [tuple(row) for row in result]
        if hint and (not rows or rows[0][-1] != lo):
            first = rows[0][-1] if rows else "none"
            raise ShardChangedError(table.described, f"block starting at key {lo}", f"first key {first}")
        rows = rows[skip:]
        return [row[:-1] for row in rows], [row[-1] for row in rows]

    def _read_ordered(
        self, start: int, end: int, pinned_rows: int | None, version: str
    ) -> tuple[list[Sequence[Any]], list[Any]]:
        table = self.table
        names = self.spec.schema.names
        order = ", ".join(table.quoted(name) for name in names)
        statement = sa.text(
            f"SELECT {table.projection(names)}, COUNT(*) OVER () AS edl_rows FROM {table.relation} "
            f"ORDER BY {order} LIMIT :n OFFSET :start"
        )
        with table.connect(DataFormatError) as connection:
            rows = [tuple(row) for row in connection.execute(statement, {"n": end - start, "start": start})]
        if rows and pinned_rows is not None and rows[0][-1] != pinned_rows:
            raise ShardChangedError(table.described, version, f"rows={rows[0][-1]}")
        return [row[:-1] for row in rows], [f"row {start + i}" for i in range(len(rows))]

    def _arrays(self, rows: list[Sequence[Any]], keys: list[Any]) -> Records:
        arrays = []
        key_name = self.table.key or "row"
        for index, column in enumerate(self.spec.schema.columns):
            values = [row[index] for row in rows]
            if any(value is None for value in values):
                if not self.table.fill_missing:
                    at = keys[values.index(None)]
                    where = f"{key_name}={at}" if self.table.key else str(at)
                    raise DataFormatError(
                        f"{self.table.described}: column {column.name!r} is NULL at {where}; filter or "
                        "coalesce it, or pass --data-options fill_missing=true"
                    )
                values = [_FILL[column.dtype] if value is None else value for value in values]
            try:
                if column.dtype == "string":
                    array = np.empty(len(values), dtype=object)
                    array[:] = [v if isinstance(v, str) else str(v) for v in values]
                else:
                    array = np.asarray(values, dtype=column.numpy_dtype)
            except (TypeError, ValueError) as error:
                raise DataFormatError(
                    f"{self.table.described}: column {column.name!r} is not all {column.dtype}: {error}"
                ) from None
            arrays.append(array)
        return tuple(arrays)


class OpenedSql(OpenedDataset):
    """A SQL dataset opened for planning: its one shard, pinned, and its sparse key index (if keyed)."""

    def __init__(self, spec: ReaderSpec, shard: ShardInfo, index: Sequence[Any], max_key: Any) -> None:
        super().__init__(spec, [shard], SqlReader(spec))
        self.index = list(index)
        self.max_key = max_key

    def describe(self, shard: str = "") -> str:
        return self.spec.url

    def locate(self, shard: str, start: int, end: int) -> str:
        """``[lo, skip, max]`` as JSON: the key of the index entry at or before ``start``, the rows to skip
        from there, and the pinned maximum key. Empty without a key."""
        if not self.index or start >= self.shards[0].records:
            return ""
        block = start // INDEX_STRIDE
        return json.dumps([self.index[block], start - block * INDEX_STRIDE, self.max_key])


class SqlFormat(DataFormat):
    """``--data-format sql``: tables and queries of SQL databases (see the module's docstring)."""

    name = "sql"
    options = _OPTIONS

    def open(self, url: str, options: dict[str, Any], what: str = "") -> OpenedDataset:
        source = SqlSource.parse(url, what)
        options = {name: str(value) for name, value in options.items()}
        table = SqlTable(source, options, what)
        with table.connect() as connection:
            sample = connection.execute(
                sa.text(f"SELECT {table.projection()} FROM {table.relation} LIMIT {SCHEMA_SAMPLE}")
            )
            names = list(sample.keys())
            rows = sample.fetchall()
            if not rows:
                raise ConfigError(f"{table.label}: no rows there")
            columns = tuple(
                Column(name, _infer(name, [row[i] for row in rows], table.label))
                for i, name in enumerate(names)
            )
            if len(set(names)) != len(names):
                raise ConfigError(f"{table.label}: column names repeat ({', '.join(names)}): alias them")
            if not table.columns:  # the projection pinned, so that a worker reads these very columns
                options["columns"] = ",".join(names)
            for name in names:
                if not _IDENTIFIER.match(name):
                    raise ConfigError(f"{table.label}: column {name!r} is not a plain name: alias it")
            spec = ReaderSpec(self.name, url, RecordSchema(columns), options)
            if table.key:
                return self._open_keyed(spec, table, connection)
            rows_now = int(
                connection.execute(sa.text(f"SELECT COUNT(*) FROM {table.relation}")).scalar() or 0
            )
            return OpenedSql(spec, ShardInfo(SHARD, rows_now, _version(None, rows_now)), [], None)

    def _open_keyed(self, spec: ReaderSpec, table: SqlTable, connection: Connection) -> OpenedSql:
        key = table.quoted(table.key)
        max_key, rows, keys, distinct = connection.execute(
            sa.text(f"SELECT MAX({key}), COUNT(*), COUNT({key}), COUNT(DISTINCT {key}) FROM {table.relation}")
        ).one()
        if keys != rows:
            raise ConfigError(f"{table.label}: key column {table.key!r} has NULLs ({rows - keys} rows)")
        if distinct != keys:
            raise ConfigError(
                f"{table.label}: key column {table.key!r} is not unique ({keys - distinct} repeated values)"
            )
        max_key = _json_key(max_key, table.label, table.key)
        result = connection.execution_options(stream_results=True).execute(
            sa.text(
                f"SELECT edl_key, edl_rows FROM (SELECT {key} AS edl_key, ROW_NUMBER() OVER (ORDER BY {key}) "
                f"AS edl_rn, COUNT(*) OVER () AS edl_rows FROM {table.relation} WHERE {key} <= :max) "
                f"AS edl_index WHERE (edl_rn - 1) % {INDEX_STRIDE} = 0 ORDER BY edl_key"
            ),
            {"max": max_key},
        )
        index: list[Any] = []
        pinned = 0
        for entry, count in result:
            index.append(_json_key(entry, table.label, table.key))
            pinned = int(count)
        return OpenedSql(spec, ShardInfo(SHARD, pinned, _version(max_key, pinned)), index, max_key)

    def range_reader(self, spec: ReaderSpec) -> RangeReader:
        return SqlReader(spec)
