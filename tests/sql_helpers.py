"""The test databases: SQLite (embedded), and the PostgreSQL and MariaDB servers of the test host or CI.

``EDL_TEST_POSTGRES_URL`` / ``EDL_TEST_MYSQL_URL`` name the server URLs. Without them the default local
servers are tried, and one not reachable within 2 s skips its tests with a reason naming it (a machine
without the servers runs the SQLite cases); with them (``.ci/run`` sets both), an unreachable server fails
its tests. Every test makes uniquely named tables and drops them.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
import sqlalchemy as sa

from edl_argo.readers.sql import database_url

DATABASES = ("sqlite", "postgresql", "mysql")
SERVER_ENV = {"postgresql": "EDL_TEST_POSTGRES_URL", "mysql": "EDL_TEST_MYSQL_URL"}
SERVER_URLS = {
    "postgresql": os.environ.get(SERVER_ENV["postgresql"], "postgresql://postgres@127.0.0.1:5432/test"),
    "mysql": os.environ.get(SERVER_ENV["mysql"], "mysql+pymysql://root@127.0.0.1:3306/test"),
}


@cache
def unreachable(name: str) -> str:
    """Why the server ``name`` cannot be used (empty if it can)."""
    url = SERVER_URLS[name]
    try:
        engine = sa.create_engine(database_url(url), connect_args={"connect_timeout": 2})
        with engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
        engine.dispose()
    except Exception as error:  # any failure: skip with the reason
        return f"{name} server at {url} not reachable: {str(error).splitlines()[0]}"
    return ""


def database_for(name: str, tmp_path: Path) -> str:
    """The URL of test database ``name`` (skipping the test if its server is unreachable)."""
    if name == "sqlite":
        return f"sqlite:///{tmp_path / 'test.db'}"
    reason = unreachable(name)
    if reason and os.environ.get(SERVER_ENV[name]):
        pytest.fail(f"{reason} ({SERVER_ENV[name]} names it, so it must be there)")
    if reason:
        pytest.skip(reason)
    return SERVER_URLS[name]


class Tables:
    """Uniquely named tables of one database, dropped at the end of the test."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = sa.create_engine(database_url(url))
        self.names: list[str] = []

    def name(self, stem: str = "t") -> str:
        name = f"edl_{stem}_{uuid.uuid4().hex[:10]}"
        self.names.append(name)
        return name

    def execute(self, statement: str, rows: list[dict] | dict | None = None) -> None:
        with self.engine.begin() as connection:
            connection.execute(sa.text(statement), rows or {})

    def drop_all(self) -> None:
        with self.engine.begin() as connection:
            for name in self.names:
                connection.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
        self.engine.dispose()


def tables_of(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tables]:
    """A :class:`Tables` of the database ``request.param`` names; a test module makes it its fixture:
    ``db = pytest.fixture(params=DATABASES)(tables_of)``."""
    tables = Tables(database_for(request.param, tmp_path))
    yield tables
    tables.drop_all()
