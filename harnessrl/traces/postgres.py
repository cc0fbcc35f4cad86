"""PostgreSQL trace store (psycopg 3) for clusters: many sidecars and launchers, one database.

In: call and rollout records. Out: durable rows; JSON columns are jsonb. Sequence numbers come from
a per-rollout counter row taken with an upsert, so concurrent writers never collide.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg

from harnessrl.traces.sql import SQLStoreBase

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS calls (
        id BIGSERIAL PRIMARY KEY,
        rollout_id TEXT NOT NULL,
        seq BIGINT NOT NULL,
        started_at DOUBLE PRECISION NOT NULL,
        finished_at DOUBLE PRECISION NOT NULL,
        endpoint TEXT NOT NULL,
        request JSONB NOT NULL,
        response JSONB,
        prompt_token_ids JSONB NOT NULL,
        choices JSONB NOT NULL,
        policy_version BIGINT,
        upstream TEXT NOT NULL,
        latency_ms DOUBLE PRECISION NOT NULL,
        status INTEGER NOT NULL,
        error TEXT,
        UNIQUE (rollout_id, seq)
    )""",
    """CREATE TABLE IF NOT EXISTS call_seq (
        rollout_id TEXT PRIMARY KEY,
        next_seq BIGINT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS rollouts (
        rollout_id TEXT PRIMARY KEY,
        task_id TEXT NOT NULL,
        group_id TEXT NOT NULL,
        attempt INTEGER NOT NULL,
        state TEXT NOT NULL,
        reward DOUBLE PRECISION,
        exit_code INTEGER,
        info JSONB NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS rollouts_group ON rollouts (group_id)",
)

_RESERVE = (
    "INSERT INTO call_seq (rollout_id, next_seq) VALUES (%s, %s) ON CONFLICT (rollout_id) "
    "DO UPDATE SET next_seq = call_seq.next_seq + EXCLUDED.next_seq RETURNING next_seq - %s"
)


class PostgresTraceStore(SQLStoreBase):
    """`PostgresTraceStore("postgresql://user@host:port/db")`; creates its tables if missing."""

    placeholder = "%s"
    for_update = " FOR UPDATE"

    def __init__(self, dsn: str, *, connect_timeout_s: float = 10.0) -> None:
        if not isinstance(dsn, str) or not dsn.startswith(("postgresql://", "postgres://")):
            raise ValueError(f"dsn must be a postgresql://... URL, got {dsn!r}")
        super().__init__()
        self.dsn = dsn
        self._connect_timeout_s = connect_timeout_s
        self._conn = self._connect()
        with self._lock, self._conn.transaction():
            # Several processes may open the same fresh database at once.
            self._conn.execute("SELECT pg_advisory_xact_lock(7246135)")
            for statement in _SCHEMA:
                self._conn.execute(statement)

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(
            self.dsn, autocommit=True, connect_timeout=max(1, int(self._connect_timeout_s))
        )

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[psycopg.Cursor[Any]]:
        if self._conn.closed:  # a dropped connection is reopened once per transaction
            self._conn = self._connect()
        with self._conn.transaction(), self._conn.cursor() as cur:
            yield cur

    def _cursor(self) -> psycopg.Cursor[Any]:
        if self._conn.closed:
            self._conn = self._connect()
        return self._conn.cursor()

    def _reserve_seqs(self, cur: Any, rollout_id: str, count: int) -> int:
        cur.execute(_RESERVE, (rollout_id, count, count))
        return int(cur.fetchone()[0])

    def _close_connection(self) -> None:
        self._conn.close()
