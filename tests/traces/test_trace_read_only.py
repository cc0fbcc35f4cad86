"""Read-only stores (SQLite `mode=ro`, PostgreSQL read-only sessions) and `select`, on both stores."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import pytest
from test_trace_stores import make_call

from harnessrl.traces import open_store
from harnessrl.traces.schema import RolloutRecord, RolloutState, UnknownRollout
from harnessrl.traces.sqlite import SQLiteTraceStore


def _fill(url: str) -> None:
    with open_store(url) as writer:
        writer.create_rollout(RolloutRecord("r1", "task-a", "s0-x-g0"))
        writer.create_rollout(RolloutRecord("r2", "task-b", "s0-x-g1"))
        writer.add_calls([make_call("r1"), make_call("r1"), make_call("r2")])


def test_read_only_store_reads_everything_and_refuses_writes(store_url: str) -> None:
    _fill(store_url)
    with open_store(store_url, read_only=True) as ro:
        assert ro.read_only
        assert [r.rollout_id for r in ro.rollouts()] == ["r1", "r2"]
        assert [c.seq for c in ro.calls("r1")] == [0, 1]
        assert ro.count_calls() == 3
        with pytest.raises(UnknownRollout):
            ro.rollout("nope")
        refused = (sqlite3.OperationalError, psycopg.errors.ReadOnlySqlTransaction)
        with pytest.raises(refused):
            ro.add_call(make_call("r1"))
        with pytest.raises(refused):
            ro.create_rollout(RolloutRecord("r3", "t", "g"))
        with pytest.raises(refused):
            ro.transition("r1", RolloutState.RUNNING)
        with pytest.raises(refused):
            ro.set_reward("r1", 1.0)
    with open_store(store_url) as again:  # nothing was written
        assert again.count_calls() == 3
        assert again.rollout("r1").state == RolloutState.QUEUED


def test_select_runs_parameterized_reads(store_url: str) -> None:
    _fill(store_url)
    with open_store(store_url, read_only=True) as ro:
        rows = ro.select(
            "SELECT rollout_id, COUNT(*) FROM calls WHERE rollout_id IN (?, ?) "
            "GROUP BY rollout_id ORDER BY rollout_id",
            ["r1", "r2"],
        )
        assert rows == [("r1", 2), ("r2", 1)]
        assert ro.select("SELECT task_id FROM rollouts WHERE group_id LIKE ?", ["s0-%g1"]) == [
            ("task-b",)
        ]
        with pytest.raises(ValueError, match="one SELECT"):
            ro.select("DELETE FROM calls")
    ro.close()
    with pytest.raises(ValueError, match="closed"):
        ro.select("SELECT 1")


def test_sqlite_read_only_explains_a_missing_corrupt_or_foreign_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        SQLiteTraceStore(tmp_path / "none.db", read_only=True)
    assert not (tmp_path / "none.db").exists()  # a read-only open creates nothing
    with pytest.raises(ValueError, match="not ':memory:'"):
        SQLiteTraceStore(":memory:", read_only=True)
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"this is not an sqlite file" * 100)
    with pytest.raises(ValueError, match="not a readable SQLite trace store"):
        SQLiteTraceStore(corrupt, read_only=True)
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t (x INTEGER)").connection.commit()
    with pytest.raises(ValueError, match=r"not a trace store: no \['calls', 'rollouts'\]"):
        SQLiteTraceStore(other, read_only=True)


def test_postgres_read_only_needs_the_tables(pg_dsn: Any) -> None:
    with pytest.raises(ValueError, match="holds no trace store"):
        open_store(pg_dsn, read_only=True)
    open_store(pg_dsn).close()  # a writer creates the tables
    with open_store(pg_dsn, read_only=True) as ro:
        assert ro.rollouts() == []
