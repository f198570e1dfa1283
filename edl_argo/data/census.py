"""A generated census-like table for the SQLFlow example (``edl-argo data census --db URL --table NAME``).

Columns: ``id`` (the primary key), ``age``, ``workclass``, ``education``, ``hours_per_week`` and an
``income`` label (0 or 1) computed from them with noise, so that a model of the four features can reach an
accuracy of about 0.85. The same ``rows`` and ``seed`` make the same table.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from edl_argo.errors import ConfigError

WORKCLASSES = ("Private", "Self-emp", "State-gov", "Federal-gov")
EDUCATIONS = ("HS-grad", "Some-college", "Bachelors", "Masters", "Doctorate")
COLUMNS = ("id", "age", "workclass", "education", "hours_per_week", "income")


def census_rows(rows: int, seed: int) -> list[dict[str, Any]]:
    """The table's rows, by column name."""
    rng = random.Random(seed)
    values = []
    for i in range(rows):
        age = rng.randint(18, 80)
        workclass = rng.choice(WORKCLASSES)
        education = rng.choice(EDUCATIONS)
        hours = round(rng.uniform(10, 70), 1)
        score = (age - 42) / 12 + (hours - 40) / 12 + {"Masters": 1.0, "Doctorate": 1.5}.get(education, 0.0)
        score += 0.8 if workclass == "Self-emp" else 0.0
        income = int(score + rng.gauss(0, 0.35) > 0.5)
        row = (i, age, workclass, education, hours, income)
        values.append(dict(zip(COLUMNS, row, strict=True)))
    return values


def write_census(db: str, table: str, rows: int, seed: int, overwrite: bool = False) -> int:
    """Create ``table`` in the database ``db`` (a SQLAlchemy URL without password: ``EDL_DB_PASSWORD``)
    holding :func:`census_rows`, in one transaction; an existing table is an error unless ``overwrite``
    (then it is replaced). Returns the rows written."""
    import sqlalchemy as sa
    from sqlalchemy import exc as sa_exc

    from edl_argo.readers.sql import SqlSource, _first_line, engine_for

    if rows <= 0:
        raise ConfigError(f"--rows {rows}: a positive number of rows")
    SqlSource.parse(f"{db}#{table}", "--db/--table")  # a database URL without password, a plain table name
    schema, _, name = table.rpartition(".")
    engine = engine_for(db, 10.0, 600.0, f"--db {db}", create=True)
    url = sa.engine.make_url(db)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)  # SQLite makes the file, not its folder
    metadata = sa.MetaData(schema=schema or None)
    census = sa.Table(
        name,
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("age", sa.Integer),
        sa.Column("workclass", sa.String(20)),
        sa.Column("education", sa.String(20)),
        sa.Column("hours_per_week", sa.Float(53)),
        sa.Column("income", sa.Integer),
    )
    try:
        with engine.begin() as connection:
            if sa.inspect(connection).has_table(name, schema=schema or None):
                if not overwrite:
                    raise ConfigError(f"table {table} exists (pass --overwrite to replace it)")
                census.drop(connection)
            census.create(connection)
            connection.execute(census.insert(), census_rows(rows, seed))
    except sa_exc.SQLAlchemyError as error:
        raise ConfigError(f"--db {db} --table {table}: {_first_line(error)}") from None
    return rows
