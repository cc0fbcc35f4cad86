"""PostgreSQL trace store (psycopg 3) for clusters: many sidecars and launchers, one database.

In: call and rollout records. Out: durable rows; JSON columns are jsonb. Sequence numbers come from
a per-rollout counter row taken with an upsert, so concurrent writers never collide.

Faults. A lost connection (the server restarted, failed over, or cut the session) is replaced by a
new one, waiting for the server up to `reconnect_timeout_s`; past that, `StoreUnavailable`. The
read or write that found the connection lost runs once more on the new one. A write is safe to run
again even when the connection broke during its COMMIT, when nobody can tell whether the server
committed it: each write transaction first claims a unique token (a row in `commit_tokens`). The
retry claims the same token; if that row exists, the first attempt committed and the retry returns
its result without writing anything twice; if not, the first attempt never will commit (claiming
the token waits on any transaction of ours still holding it), and the retry writes.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict

from harnessrl.traces.sql import SQLStoreBase, StoreUnavailable, schema

T = TypeVar("T")

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
# One row per store (its last committed write) and one per process killed mid-write.
_TOKENS = (
    "CREATE TABLE IF NOT EXISTS commit_tokens (token TEXT PRIMARY KEY, "
    "created_at DOUBLE PRECISION NOT NULL)"
)
_TOKEN_TTL_S = 86_400.0  # a killed writer's token matters to nobody after a day

_RESERVE = (
    "INSERT INTO call_seq (rollout_id, next_seq) VALUES (%s, %s) ON CONFLICT (rollout_id) "
    "DO UPDATE SET next_seq = call_seq.next_seq + EXCLUDED.next_seq RETURNING next_seq - %s"
)
# A write's first statement: drop this store's previous token (that write is known committed)
# and claim this write's token. No row inserted: an earlier attempt of this write committed.
_CLAIM = (
    "WITH gone AS (DELETE FROM commit_tokens WHERE token = %s) "
    "INSERT INTO commit_tokens (token, created_at) VALUES (%s, %s) ON CONFLICT (token) DO NOTHING"
)


class _Committed(Exception):
    """The token was already there: roll back the retry, the first attempt's write stands."""


class PostgresTraceStore(SQLStoreBase):
    """`PostgresTraceStore("postgresql://user@host:port/db")`; creates its tables if missing.

    `read_only=True` makes every transaction of the session read-only (the server refuses
    writes) and creates nothing. `reconnect_timeout_s` bounds how long a read or write waits for
    the server to come back after losing the connection; `lock_timeout_s`, how long a statement
    waits for a row another session holds.
    """

    placeholder = "%s"
    for_update = " FOR UPDATE"

    def __init__(
        self,
        dsn: str,
        *,
        connect_timeout_s: float = 10.0,
        reconnect_timeout_s: float = 30.0,
        lock_timeout_s: float = 30.0,
        read_only: bool = False,
    ) -> None:
        if not isinstance(dsn, str) or not dsn.startswith(("postgresql://", "postgres://")):
            raise ValueError(f"dsn must be a postgresql://... URL, got {dsn!r}")
        for name, value in (
            ("connect_timeout_s", connect_timeout_s),
            ("reconnect_timeout_s", reconnect_timeout_s),
            ("lock_timeout_s", lock_timeout_s),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        super().__init__(read_only)
        self.dsn = dsn
        info = conninfo_to_dict(dsn)  # where, for messages (never the password)
        self._where = f"{info.get('host', 'localhost')}:{info.get('port', 5432)}"
        self._connect_timeout_s = connect_timeout_s
        self._reconnect_s = float(reconnect_timeout_s)
        self._lock_ms = int(lock_timeout_s * 1000)
        self._down_since: float | None = None  # when the server was first found unreachable
        self._last_token: str | None = None
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
            for statement in [*schema(_TYPES, "BIGSERIAL"), _CALL_SEQ, _TOKENS]:
                self._conn.execute(statement)
            self._conn.execute(
                "DELETE FROM commit_tokens WHERE created_at < %s", (time.time() - _TOKEN_TTL_S,)
            )

    def _connect(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(
            self.dsn, autocommit=True, connect_timeout=max(1, int(self._connect_timeout_s))
        )
        # A session of ours is never idle inside a transaction for long: one that is has lost its
        # client, and its locks (rows, a claimed token) would stall the retry on a new connection.
        settings = [
            f"SET lock_timeout = {self._lock_ms}",
            f"SET idle_in_transaction_session_timeout = {max(1000, self._lock_ms // 2)}",
        ]
        if self.read_only:
            settings.append("SET default_transaction_read_only = on")
        try:
            conn.execute("; ".join(settings))
        except BaseException:
            conn.close()
            raise
        return conn

    def _reconnect(self) -> None:
        """A new connection if the current one is lost, waiting for the server up to the
        reconnect budget (counted from when it was first found unreachable)."""
        if not self._conn.closed:
            return
        if self._down_since is None:
            self._down_since = time.monotonic()
        delay = 0.05
        while True:
            try:
                self._conn = self._connect()
            except psycopg.OperationalError as err:
                left = self._down_since + self._reconnect_s - time.monotonic()
                if left <= 0:
                    raise StoreUnavailable(
                        f"PostgreSQL at {self._where} unreachable for {self._reconnect_s:g}s "
                        f"(reconnect_timeout_s): {str(err).strip()}"
                    ) from err
                time.sleep(min(delay, left))
                delay = min(2 * delay, 0.25)  # refused connects are cheap: answer soon
            else:
                self._down_since = None
                return

    def _give_up(self, err: Exception, attempt: int, what: str) -> None:
        """Raise unless `err` is a lost connection on the first attempt (which is retried)."""
        if not (isinstance(err, psycopg.OperationalError) and self._conn.closed):
            raise err  # an error of the statement itself, on a live connection
        if attempt == 2:
            raise StoreUnavailable(
                f"PostgreSQL at {self._where} dropped the connection twice during one {what}: "
                f"{str(err).strip()}"
            ) from err

    def _write(self, body: Callable[[Any], T]) -> T:
        token = uuid.uuid4().hex
        done: list[T] = []  # body's result, once it ran to the COMMIT
        with self._locked():
            for attempt in (1, 2):
                try:
                    self._reconnect()
                    with self._transaction() as cur:
                        cur.execute(_CLAIM, (self._last_token, token, time.time()))
                        if cur.rowcount == 0:
                            raise _Committed
                        done[:] = [body(cur)]
                except _Committed:
                    # Only a transaction that ran `body` to its end can have committed.
                    assert done, "a write's token was committed before its body ran"
                except Exception as err:
                    self._give_up(err, attempt, "write (it may or may not have been stored)")
                    continue
                self._last_token = token
                return done[0]
        raise AssertionError("unreachable")  # pragma: no cover

    def _read(self, body: Callable[[Any], T]) -> T:
        with self._locked():
            for attempt in (1, 2):
                try:
                    self._reconnect()
                    return body(self._cursor())
                except Exception as err:
                    self._give_up(err, attempt, "read")
        raise AssertionError("unreachable")  # pragma: no cover

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[psycopg.Cursor[Any]]:
        with self._conn.transaction(), self._conn.cursor() as cur:
            yield cur

    def _cursor(self) -> psycopg.Cursor[Any]:
        return self._conn.cursor()

    def _reserve_seqs(self, cur: Any, rollout_id: str, count: int) -> int:
        cur.execute(_RESERVE, (rollout_id, count, count))
        return int(cur.fetchone()[0])

    def _close_connection(self) -> None:
        self._conn.close()
