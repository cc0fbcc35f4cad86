"""The SQL shared by the trace stores: calls (append-only) and rollouts (a small state machine).

In: records from the sidecar and the launcher. Out: the `TraceStore` protocol implemented over a
DB-API connection. Subclasses supply the connection, the transaction and how a rollout's next
sequence numbers are reserved; the statements use `?` and are rewritten once for other drivers.
Every write is one function of a cursor run by `_write`, every read one run by `_read`, so a store
whose connection can be lost (PostgreSQL) can run either again on a new connection.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from harnessrl.traces import rows
from harnessrl.traces.schema import (
    CallRecord,
    RolloutRecord,
    RolloutState,
    UnknownRollout,
    check_transition,
)

T = TypeVar("T")

_CALL_COLS = ", ".join(rows.CALL_COLUMNS)
_ROLLOUT_COLS = ", ".join(rows.ROLLOUT_COLUMNS)


class StoreUnavailable(ConnectionError):
    """The store's server could not be reached within its reconnect budget; nothing was written
    (or, for a write whose outcome stayed unknown, it may have been: the message says which)."""


def schema(types: Mapping[str, str], call_id: str) -> list[str]:
    """CREATE statements of both tables, column kinds spelled in a store's SQL `types`."""

    def columns(table: Mapping[str, str]) -> str:
        null = {True: "", False: " NOT NULL"}
        return ", ".join(
            f"{name} {types[kind.rstrip('?')]}{null[kind.endswith('?')]}"
            for name, kind in table.items()
        )

    return [
        f"CREATE TABLE IF NOT EXISTS calls (id {call_id} PRIMARY KEY, "
        f"{columns(rows.CALL_COLUMNS)}, UNIQUE (rollout_id, seq))",
        f"CREATE TABLE IF NOT EXISTS rollouts ({columns(rows.ROLLOUT_COLUMNS)}, "
        "PRIMARY KEY (rollout_id))",
        "CREATE INDEX IF NOT EXISTS rollouts_group ON rollouts (group_id)",
        # The viewer pages through rollouts in creation order and filters them by task.
        "CREATE INDEX IF NOT EXISTS rollouts_created ON rollouts (created_at, rollout_id)",
        "CREATE INDEX IF NOT EXISTS rollouts_task ON rollouts (task_id)",
    ]


class SQLStoreBase:
    """Thread-safe trace store over one connection (callers in several threads share a lock)."""

    placeholder = "?"
    for_update = ""  # row lock suffix for read-modify-write; SQLite locks the whole database

    def __init__(self, read_only: bool = False) -> None:
        self._lock = threading.RLock()
        self._closed = False
        self.read_only = read_only  # the database refuses every write (tools that only look)
        self._sql = {
            "insert_call": f"INSERT INTO calls ({_CALL_COLS}) VALUES "
            f"({', '.join('?' * len(rows.CALL_COLUMNS))})",
            "calls": f"SELECT {_CALL_COLS} FROM calls WHERE rollout_id = ? ORDER BY seq",
            "count": "SELECT COUNT(*) FROM calls",
            "count_rollout": "SELECT COUNT(*) FROM calls WHERE rollout_id = ?",
            "insert_rollout": f"INSERT INTO rollouts ({_ROLLOUT_COLS}) VALUES "
            f"({', '.join('?' * len(rows.ROLLOUT_COLUMNS))}) ON CONFLICT (rollout_id) DO NOTHING",
            "rollout": f"SELECT {_ROLLOUT_COLS} FROM rollouts WHERE rollout_id = ?",
            "rollouts": f"SELECT {_ROLLOUT_COLS} FROM rollouts ORDER BY created_at, rollout_id",
            "rollouts_group": f"SELECT {_ROLLOUT_COLS} FROM rollouts WHERE group_id = ? "
            "ORDER BY created_at, rollout_id",
            "update_rollout": "UPDATE rollouts SET state = ?, reward = ?, exit_code = ?, "
            "info = ?, updated_at = ? WHERE rollout_id = ?",
            "set_reward": "UPDATE rollouts SET reward = ?, updated_at = ? WHERE rollout_id = ?",
        }
        if self.placeholder != "?":
            self._sql = {k: v.replace("?", self.placeholder) for k, v in self._sql.items()}

    # --- what subclasses provide -------------------------------------------------------------
    def _transaction(self) -> contextlib.AbstractContextManager[Any]:  # pragma: no cover
        raise NotImplementedError

    def _cursor(self) -> Any:  # pragma: no cover
        raise NotImplementedError

    def _reserve_seqs(self, cur: Any, rollout_id: str, count: int) -> int:  # pragma: no cover
        """Reserve `count` consecutive sequence numbers of a rollout; returns the first."""
        raise NotImplementedError

    def _close_connection(self) -> None:  # pragma: no cover
        raise NotImplementedError

    def _write(self, body: Callable[[Any], T]) -> T:
        """`body(cursor)` in one write transaction; its result once the transaction committed."""
        with self._locked(), self._transaction() as cur:
            return body(cur)

    def _read(self, body: Callable[[Any], T]) -> T:
        """`body(cursor)` outside any write transaction."""
        with self._locked():
            return body(self._cursor())

    # --- calls -------------------------------------------------------------------------------
    def add_call(self, call: CallRecord) -> int:
        return self.add_calls([call])[0]

    def add_calls(self, calls: list[CallRecord]) -> list[int]:
        for call in calls:
            rows.check_call(call)
        if not calls:
            return []
        counts: dict[str, int] = {}
        for call in calls:
            counts[call.rollout_id] = counts.get(call.rollout_id, 0) + 1

        def insert(cur: Any) -> list[int]:
            nxt = {rid: self._reserve_seqs(cur, rid, n) for rid, n in counts.items()}
            seqs = []
            for call in calls:
                seqs.append(nxt[call.rollout_id])
                nxt[call.rollout_id] += 1
            cur.executemany(
                self._sql["insert_call"],
                [rows.call_to_row(c, s) for c, s in zip(calls, seqs, strict=True)],
            )
            return seqs

        return self._write(insert)

    def calls(self, rollout_id: str) -> list[CallRecord]:
        return [rows.row_to_call(r) for r in self._fetch("calls", rollout_id)]

    def count_calls(self, rollout_id: str | None = None) -> int:
        found = (
            self._fetch("count") if rollout_id is None else self._fetch("count_rollout", rollout_id)
        )
        return int(found[0][0])

    # --- rollouts ----------------------------------------------------------------------------
    def create_rollout(self, rollout: RolloutRecord) -> None:
        rows.check_rollout(rollout)
        now = time.time()
        row = list(rows.rollout_to_row(rollout))
        row[8] = rollout.created_at or now
        row[9] = rollout.updated_at or now

        def insert(cur: Any) -> None:
            cur.execute(self._sql["insert_rollout"], row)
            if cur.rowcount == 0:
                raise ValueError(
                    f"rollout {rollout.rollout_id!r} already exists; use a new rollout_id "
                    "(attempts of one task differ by rollout_id and attempt)"
                )

        self._write(insert)

    def rollout(self, rollout_id: str) -> RolloutRecord:
        found = self._fetch("rollout", rollout_id)
        if not found:
            raise UnknownRollout(rollout_id)
        return rows.row_to_rollout(found[0])

    def rollouts(self, group_id: str | None = None) -> list[RolloutRecord]:
        found = (
            self._fetch("rollouts") if group_id is None else self._fetch("rollouts_group", group_id)
        )
        return [rows.row_to_rollout(r) for r in found]

    def transition(self, rollout_id: str, state: RolloutState, **fields: Any) -> RolloutRecord:
        try:
            target = RolloutState(state)
        except ValueError as err:
            raise ValueError(
                f"state must be one of {[s.value for s in RolloutState]}, got {state!r}"
            ) from err
        fields = rows.check_fields(fields)

        def update(cur: Any) -> None:
            cur.execute(self._sql["rollout"] + self.for_update, (rollout_id,))
            row = cur.fetchone()
            if row is None:
                raise UnknownRollout(rollout_id)
            current = rows.row_to_rollout(row)
            check_transition(rollout_id, current.state, target)
            info = {**current.info, **fields.get("info", {})}
            reward = fields.get("reward", current.reward)
            exit_code = fields.get("exit_code", current.exit_code)
            now = time.time()
            cur.execute(
                self._sql["update_rollout"],
                (target.value, reward, exit_code, rows.dumps(info), now, rollout_id),
            )

        self._write(update)
        return self.rollout(rollout_id)

    def set_reward(self, rollout_id: str, reward: float) -> RolloutRecord:
        value = rows.check_reward(reward)

        def update(cur: Any) -> None:
            cur.execute(self._sql["set_reward"], (value, time.time(), rollout_id))
            if cur.rowcount == 0:
                raise UnknownRollout(rollout_id)

        self._write(update)
        return self.rollout(rollout_id)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._close_connection()

    def select(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Rows of one SELECT over the tables above, `?` placeholders (rewritten for the driver).

        For tools that read the store in their own shape (the trace viewer); `rows.row_to_call`
        and `rows.row_to_rollout` decode full rows.
        """
        if not isinstance(sql, str) or not sql.lstrip()[:6].upper() == "SELECT":
            raise ValueError(f"select() runs one SELECT statement, got {sql!r:.80}")
        if self.placeholder != "?":
            sql = sql.replace("?", self.placeholder)
        query = sql

        def run(cur: Any) -> list[tuple[Any, ...]]:
            cur.execute(query, tuple(args))
            return [tuple(r) for r in cur.fetchall()]

        return self._read(run)

    # --- helpers -----------------------------------------------------------------------------
    def _fetch(self, statement: str, *args: Any) -> list[Any]:
        """Every row one of the read statements returns (outside any write transaction)."""

        def run(cur: Any) -> list[Any]:
            cur.execute(self._sql[statement], args)
            return list(cur.fetchall())

        return self._read(run)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            if self._closed:
                raise ValueError(f"{type(self).__name__} is closed; open a new store")
            yield

    def __enter__(self) -> SQLStoreBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
