"""Trace-store fixtures: every store test runs on SQLite and on a throwaway PostgreSQL cluster."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pg_cluster import pg_ctl, pg_dsn, pg_server  # noqa: F401  (fixtures)

from harnessrl.traces.postgres import PostgresTraceStore
from harnessrl.traces.sqlite import SQLiteTraceStore


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/traces.db"
    return str(request.getfixturevalue("pg_dsn"))


@pytest.fixture
def store(store_url: str) -> Iterator[SQLiteTraceStore | PostgresTraceStore]:
    from harnessrl.traces import open_store

    s = open_store(store_url)
    yield s
    s.close()
