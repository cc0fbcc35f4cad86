"""PostgreSQL trace store (psycopg 3) for clusters: many sidecars and launchers, one database.

In: call and rollout records. Out: durable rows; JSON columns are jsonb. Sequence numbers come from
a per-rollout counter row taken with an upsert, so concurrent writers never collide.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg

from harnessrl.traces.sql import SQLStoreBase, schema

_TYPES = {
    "text": "TEXT",
    "int": "INTEGER",
    "bigint": "BIGINT",
    "real": "DOUBLE PRECISION",
    "json": "JSONB",
}
_CALL_SEQ = (
    "CREATE TABLE IF NOT EXISTS call_seq (rollout_id TEXT PRIMARY KEY, next_seq BIGINT NOT NULL)"
)

_RESERVE = (
    "INSERT INTO call_seq (rollout_id, next_seq) VALUES (%s, %s) ON CONFLICT (rollout_id) "
    "DO UPDATE SET next_seq = call_seq.next_seq + EXCLUDED.next_seq RETURNING next_seq - %s"
)


class PostgresTraceStore(SQLStoreBase):
    """`PostgresTraceStore("postgresql://user@host:port/db")`; creates its tables if missing.

    `read_only=True` makes every transaction of the session read-only (the server refuses
    writes) and creates nothing.
    """

    placeholder = "%s"
    for_update = " FOR UPDATE"

    def __init__(
        self, dsn: str, *, connect_timeout_s: float = 10.0, read_only: bool = False
    ) -> None:
        if not isinstance(dsn, str) or not dsn.startswith(("postgresql://", "postgres://")):
            raise ValueError(f"dsn must be a postgresql://... URL, got {dsn!r}")
        super().__init__(read_only)
        self.dsn = dsn
        self._connect_timeout_s = connect_timeout_s
        self._conn = self._connect()
        if read_only:
            found = self._conn.execute(
                "SELECT count(*) FROM information_schema.tables "
                "WHERE table_schema = current_schema() AND table_name IN ('calls', 'rollouts')"
            ).fetchone()
            if found is None or found[0] != 2:
                self._conn.close()
                raise ValueError(f"{dsn!r} holds no trace store (no calls and rollouts tables)")
            return
        with self._lock, self._conn.transaction():
            # Several processes may open the same fresh database at once.
            self._conn.execute("SELECT pg_advisory_xact_lock(7246135)")
            for statement in [*schema(_TYPES, "BIGSERIAL"), _CALL_SEQ]:
                self._conn.execute(statement)

    def _connect(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(
            self.dsn, autocommit=True, connect_timeout=max(1, int(self._connect_timeout_s))
        )
        if self.read_only:
            conn.execute("SET default_transaction_read_only = on")
        return conn

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
