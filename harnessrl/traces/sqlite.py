"""SQLite trace store: the embedded default, one file in WAL mode.

In: call and rollout records from the sidecar and the launcher (possibly in other processes).
Out: durable rows. A commit returns only after SQLite has written the WAL frames, so a call that
was committed survives `kill -9` of any process; `synchronous="FULL"` also survives power loss.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harnessrl.traces.schema import CallRecord
from harnessrl.traces.sql import SQLStoreBase, schema

log = logging.getLogger("harnessrl.traces.sqlite")

_TYPES = {"text": "TEXT", "int": "INTEGER", "bigint": "INTEGER", "real": "REAL", "json": "TEXT"}

SYNCHRONOUS_MODES = ("NORMAL", "FULL")


def is_busy(err: BaseException) -> bool:
    """`err` is SQLite saying another connection holds the lock it needed."""
    code = getattr(err, "sqlite_errorcode", None)
    return (
        isinstance(err, sqlite3.OperationalError)
        and code is not None
        and code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    )


def _open_read_only(path: str, timeout_s: float) -> sqlite3.Connection:
    """A connection SQLite itself refuses writes on; the file must already be a trace store."""
    if path == ":memory:":
        raise ValueError("a read-only store needs a database file, not ':memory:'")
    if not os.path.isfile(path):
        raise ValueError(f"no trace store at {path!r}: the file does not exist")
    uri = Path(path).absolute().as_uri() + "?mode=ro"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False,
                           timeout=timeout_s)  # fmt: skip
    try:
        found = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as err:  # "file is not a database", a torn header, ...
        conn.close()
        raise ValueError(f"{path!r} is not a readable SQLite trace store: {err}") from err
    missing = sorted({"calls", "rollouts"} - found)
    if missing:
        conn.close()
        raise ValueError(
            f"{path!r} is an SQLite database but not a trace store: no {missing} table"
        )
    return conn


class SQLiteTraceStore(SQLStoreBase):
    """`SQLiteTraceStore(path)`; `synchronous="FULL"` fsyncs every commit (power-loss safe).

    `background_checkpoint=True` moves WAL checkpoints (the only step that fsyncs the database
    file in NORMAL mode) off the writing thread onto a helper thread, so commits stay short.
    A write waits up to `busy_timeout_s` for another connection's write lock, then fails.
    `read_only=True` opens an existing store that nothing through this object can change.
    """

    # A local commit takes tens of microseconds: an event loop may write inline with
    # `try_add_calls`, which never waits (see proxy_sidecar.recorder).
    inline_writes = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: str = "NORMAL",
        background_checkpoint: bool = False,
        checkpoint_interval_s: float = 0.5,
        busy_timeout_s: float = 30.0,
        read_only: bool = False,
    ) -> None:
        if not isinstance(path, str | os.PathLike) or not str(path):
            raise ValueError(f"path must be a file path or ':memory:', got {path!r}")
        if synchronous not in SYNCHRONOUS_MODES:
            raise ValueError(f"synchronous must be one of {SYNCHRONOUS_MODES}, got {synchronous!r}")
        if not 0 < busy_timeout_s <= 3600:
            raise ValueError(f"busy_timeout_s must be in (0, 3600], got {busy_timeout_s!r}")
        super().__init__(read_only)
        # How long a write waits for another connection's write lock before it fails.
        self._busy_ms = int(busy_timeout_s * 1000)
        self.path = str(path)
        parent = os.path.dirname(os.path.abspath(self.path))
        if self.path != ":memory:" and not os.path.isdir(parent):
            raise ValueError(f"path {self.path!r}: directory {parent!r} does not exist; create it")
        self._stop = threading.Event()
        self._checkpointer: threading.Thread | None = None
        if read_only:
            self._conn = _open_read_only(self.path, busy_timeout_s)
            return
        # Autocommit mode: transactions are explicit (BEGIN IMMEDIATE takes the write lock up
        # front, so reserving sequence numbers never races another writer process).
        self._conn = sqlite3.connect(
            self.path,
            isolation_level=None,
            check_same_thread=False,
            timeout=busy_timeout_s,
        )
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute(f"PRAGMA synchronous={synchronous}")
        self._conn.execute("PRAGMA journal_size_limit=67108864")  # WAL shrinks back to 64 MiB
        with self._transaction() as cur:
            for statement in schema(_TYPES, "INTEGER"):
                cur.execute(statement)
        if background_checkpoint and self.path != ":memory:":
            self._conn.execute("PRAGMA wal_autocheckpoint=0")
            self._checkpointer = threading.Thread(
                target=self._checkpoint_loop, args=(checkpoint_interval_s,), daemon=True
            )
            self._checkpointer.start()

    def _checkpoint_loop(self, interval_s: float) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=30.0)
        try:
            while not self._stop.wait(interval_s):
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
                except sqlite3.Error as err:
                    # Keep going: with autocheckpoint off, a dead helper would let the WAL grow
                    # without bound.
                    log.warning("WAL checkpoint of %s failed: %s", self.path, err)
        finally:
            conn.close()

    def try_add_calls(self, calls: list[CallRecord]) -> list[int] | None:
        """`add_calls` if it commits without waiting; None, with nothing written, if another
        thread or process holds the write lock. An event loop can write inline and never block."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._closed:
                raise ValueError(f"{type(self).__name__} is closed; open a new store")
            self._conn.execute("PRAGMA busy_timeout=0")
            try:
                return self.add_calls(calls)
            except sqlite3.OperationalError as err:
                if is_busy(err):  # the transaction was rolled back: nothing written
                    return None
                raise
            finally:
                self._conn.execute(f"PRAGMA busy_timeout={self._busy_ms}")
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Cursor]:
        cur = self._conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            yield cur
        except BaseException:
            self._conn.rollback()
            raise
        else:
            cur.execute("COMMIT")
        finally:
            cur.close()

    def _cursor(self) -> sqlite3.Cursor:
        return self._conn.cursor()

    def _reserve_seqs(self, cur: Any, rollout_id: str, count: int) -> int:
        cur.execute(
            "SELECT COALESCE(MAX(seq) + 1, 0) FROM calls WHERE rollout_id = ?", (rollout_id,)
        )
        return int(cur.fetchone()[0])

    def _close_connection(self) -> None:
        if self._checkpointer is not None:
            self._stop.set()
            self._checkpointer.join()
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        self._conn.close()
