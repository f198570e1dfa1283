"""The SQL reader (edl_argo/readers/sql.py) against SQLite, PostgreSQL and MariaDB."""

from __future__ import annotations

import random

import numpy as np
import pytest
from sql_helpers import DATABASES, Tables, tables_of

from edl_argo.errors import ConfigError, DataFormatError
from edl_argo.readers import ReaderSpec, num_records, open_data, range_reader
from edl_argo.readers.sql import INDEX_STRIDE, SqlSource
from edl_argo.recordio.reader import ShardChangedError

db = pytest.fixture(params=DATABASES)(tables_of)
ROWS = 300  # not a multiple of the index stride: the last block is partial


def make_people(db: Tables, rows: int = ROWS, nulls: bool = False) -> str:
    """A table of ``rows`` rows with ids in shuffled insertion order (so key order is not insertion
    order), an integer, a float, a text and a boolean column."""
    table = db.name("people")
    db.execute(
        f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, age INTEGER, income DOUBLE PRECISION, "
        "name VARCHAR(40), active BOOLEAN)"
    )
    ids = list(range(1, rows + 1))
    random.Random(7).shuffle(ids)
    db.execute(
        f"INSERT INTO {table} (id, age, income, name, active) VALUES (:id, :age, :income, :name, :active)",
        [
            {
                "id": i * 3,
                "age": None if nulls and i == 5 else 20 + i % 50,
                "income": i * 1.5,
                "name": f"person {i}",
                "active": i % 2 == 0,
            }
            for i in ids
        ],
    )
    return table


def expected(rows: int = ROWS) -> dict[str, list]:
    ids = range(1, rows + 1)
    return {
        "id": [i * 3 for i in ids],
        "age": [20 + i % 50 for i in ids],
        "income": [i * 1.5 for i in ids],
        "name": [f"person {i}" for i in ids],
    }


def read_via_spec(opened, start: int, end: int):
    """Records [start, end) as a worker reads them: a reader made from the spec's JSON, with the hint."""
    reader = range_reader(ReaderSpec.from_json(opened.spec.to_json()))
    shard = opened.shards[0]
    return reader.read(
        shard.key, start, end, version=shard.version, hint=opened.locate(shard.key, start, end)
    )


def test_keyed_random_ranges_equal_rows_in_key_order(db: Tables) -> None:
    table = make_people(db)
    opened = open_data(f"{db.url}#{table}", "sql", {"key": "id", "columns": "id,age,income,name"})
    assert opened.records == {"0": ROWS}
    assert opened.schema.dtypes == ("int64", "int64", "float64", "string")
    want = expected()
    rng = random.Random(1)
    cuts = [
        (0, ROWS),
        (ROWS - 1, ROWS),
        (INDEX_STRIDE - 1, INDEX_STRIDE + 1),
        (INDEX_STRIDE, 2 * INDEX_STRIDE),
    ]
    cuts += [tuple(sorted(rng.sample(range(ROWS + 1), 2))) for _ in range(12)]
    for start, end in cuts:
        records = read_via_spec(opened, start, end)
        assert num_records(records) == end - start
        ids, ages, incomes, names = records
        assert ids.dtype == np.int64 and ages.dtype == np.int64 and incomes.dtype == np.float64
        assert names.dtype == object
        assert ids.tolist() == want["id"][start:end]
        assert ages.tolist() == want["age"][start:end]
        assert incomes.tolist() == want["income"][start:end]
        assert names.tolist() == want["name"][start:end]
    # no hint: the worker finds the range's first key itself
    shard = opened.shards[0]
    plain = range_reader(opened.spec).read("0", 100, 130, version=shard.version)
    assert plain[0].tolist() == want["id"][100:130]


def test_a_query_with_a_key_and_the_boolean_column(db: Tables) -> None:
    table = make_people(db)
    opened = open_data(f"{db.url}#SELECT id, active FROM {table} WHERE id > 30", "sql", {"key": "id"})
    assert opened.records == {"0": ROWS - 10}
    # MySQL/MariaDB keeps BOOLEAN as TINYINT: its values are integers
    assert opened.schema.dtypes[1] in ("bool", "int64")
    ids, active = read_via_spec(opened, 5, 70)
    assert ids.tolist() == [i * 3 for i in range(16, 81)]
    assert active.astype(bool).tolist() == [i % 2 == 0 for i in range(16, 81)]


def test_rows_inserted_after_open_are_not_read(db: Tables) -> None:
    table = make_people(db, rows=100)
    opened = open_data(f"{db.url}#{table}", "sql", {"key": "id", "columns": "id"})
    db.execute(f"INSERT INTO {table} (id, age, income, name, active) VALUES (1000, 1, 1.0, 'late', true)")
    assert opened.records == {"0": 100}
    (ids,) = read_via_spec(opened, 90, 100)
    assert ids.tolist() == [i * 3 for i in range(91, 101)]
    assert 1000 not in read_via_spec(opened, 0, 100)[0].tolist()


def test_without_key_reads_in_column_order_and_a_changed_table_fails(db: Tables) -> None:
    table = make_people(db, rows=120)
    opened = open_data(f"{db.url}#{table}", "sql", {"columns": "name,age"})
    assert opened.shards[0].version == "rows=120"
    names, ages = read_via_spec(opened, 0, 120)
    pairs = sorted((f"person {i}", 20 + i % 50) for i in range(1, 121))
    assert list(zip(names.tolist(), ages.tolist(), strict=True)) == pairs
    names, _ = read_via_spec(opened, 37, 41)
    assert names.tolist() == [name for name, _ in pairs[37:41]]
    db.execute(f"DELETE FROM {table} WHERE id = 3")
    with pytest.raises(ShardChangedError, match=table):
        read_via_spec(opened, 0, 10)


def test_projection_of_a_table_reads_only_those_columns(db: Tables) -> None:
    table = make_people(db, rows=10)
    opened = open_data(f"{db.url}#{table}", "sql", {"key": "id", "columns": "name"})
    assert opened.schema.names == ("name",)
    assert read_via_spec(opened, 0, 3)[0].tolist() == ["person 1", "person 2", "person 3"]
    everything = open_data(f"{db.url}#{table}", "sql", {"key": "id"})
    assert everything.schema.names == ("id", "age", "income", "name", "active")


def test_a_null_names_table_column_and_key_unless_filled(db: Tables) -> None:
    table = make_people(db, rows=10, nulls=True)
    opened = open_data(f"{db.url}#{table}", "sql", {"key": "id", "columns": "id,age"})
    with pytest.raises(DataFormatError, match=rf"{table}: column 'age' is NULL at id=15;"):
        read_via_spec(opened, 0, 10)
    filled = open_data(f"{db.url}#{table}", "sql", {"key": "id", "columns": "id,age", "fill_missing": "true"})
    _, ages = read_via_spec(filled, 0, 10)
    assert ages.tolist()[4] == 0 and ages.dtype == np.int64


def test_bad_table_and_query_are_one_line_naming_the_url(db: Tables) -> None:
    url = f"{db.url}#edl_no_such_table"
    with pytest.raises(ConfigError) as caught:
        open_data(url, "sql", {}, what="--training-data")
    message = str(caught.value)
    assert message.startswith(f"--training-data {url}: ") and "edl_no_such_table" in message
    assert "\n" not in message
    with pytest.raises(ConfigError, match="SELEC nonsense"):
        open_data(f"{db.url}#SELECT * FROM (SELEC nonsense) x", "sql", {})
    table = make_people(db, rows=3)
    with pytest.raises(ConfigError, match=f"{table}: .*no_such_column"):
        open_data(f"{db.url}#{table}", "sql", {"columns": "no_such_column"})


def test_unreachable_database_is_one_line() -> None:
    url = "postgresql://postgres@127.0.0.1:1/test#census"
    with pytest.raises(ConfigError, match=r"^postgresql://postgres@127.0.0.1:1/test#census: .*127\.0\.0\.1"):
        open_data(url, "sql", {"connect_timeout": "2"})


@pytest.mark.parametrize(
    ("database", "named"),
    [
        ("foo://x", "unsupported database dialect 'foo'"),
        ("postgresql+nodriver://h/d", "unsupported database dialect 'postgresql+nodriver'"),
        ("sqlite+pysqlcipher:///x.db", "the driver of 'sqlite+pysqlcipher' is not installed"),
    ],
)
def test_a_database_without_a_dialect_or_driver_here_is_one_line_naming_it(database: str, named: str) -> None:
    url = f"{database}#t"
    with pytest.raises(ConfigError) as caught:
        open_data(url, "sql", {}, what="--training-data")
    message = str(caught.value)
    assert message.startswith(f"--training-data {url}: {named}"), message
    assert "postgresql" in message.removeprefix(f"--training-data {url}: {named}")  # what can be used


def test_reading_a_sqlite_database_that_is_not_there_makes_none(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for path in (tmp_path / "nosuch.db", tmp_path / "nodir" / "x.db", "relative.db"):
        url = f"sqlite:///{path}#t"
        with pytest.raises(ConfigError) as caught:
            open_data(url, "sql", {}, what="--training-data")
        assert str(caught.value) == f"--training-data {url}: no SQLite database at {path}"
        with pytest.raises(ConfigError, match=f"no SQLite database at {path}"):
            range_reader(ReaderSpec("sql", url))  # a worker's reader
    assert list(tmp_path.iterdir()) == []


def test_a_password_in_the_url_is_refused_and_the_environment_gives_it(monkeypatch) -> None:
    with pytest.raises(ConfigError, match="EDL_DB_PASSWORD") as caught:
        SqlSource.parse("postgresql://postgres:hunter2@127.0.0.1:5432/test#census")
    assert "hunter2" not in str(caught.value)
    from edl_argo.readers.sql import database_url

    monkeypatch.setenv("EDL_DB_PASSWORD", "s3cret")
    url = database_url("postgresql://postgres@db:5432/test")
    assert url.password == "s3cret" and url.drivername == "postgresql+psycopg2"
    spec = ReaderSpec("sql", "postgresql://postgres@db:5432/test#census")
    assert "s3cret" not in spec.to_json()


def test_unsupported_types_and_options_are_config_errors(tmp_path) -> None:
    tables = Tables(f"sqlite:///{tmp_path / 'x.db'}")
    tables.execute("CREATE TABLE blobs (id INTEGER, data BLOB)")
    tables.execute("INSERT INTO blobs VALUES (1, x'00ff')")
    with pytest.raises(ConfigError, match="column 'data' has values of type bytes"):
        open_data(f"{tables.url}#blobs", "sql", {})
    with pytest.raises(ConfigError, match="keys: not an option"):
        open_data(f"{tables.url}#blobs", "sql", {"keys": "id"})
    with pytest.raises(ConfigError, match="names its table or query after '#'"):
        open_data(tables.url, "sql", {})
