"""SQLite specifics: WAL mode, durability settings, URL parsing, and a hard kill after commit."""

from __future__ import annotations

import os
import pathlib
import signal
import sqlite3
import subprocess
import sys
import time
from typing import Any

import pytest

from harnessrl.traces import open_store
from harnessrl.traces.sqlite import SQLiteTraceStore


def test_wal_and_synchronous_modes(tmp_path: pathlib.Path) -> None:
    s = SQLiteTraceStore(tmp_path / "a.db", synchronous="FULL")
    mode = s._conn.execute("PRAGMA journal_mode").fetchone()[0]
    sync = s._conn.execute("PRAGMA synchronous").fetchone()[0]
    assert (mode, sync) == ("wal", 2)
    s.close()


def test_constructor_and_url_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="synchronous"):
        SQLiteTraceStore(tmp_path / "a.db", synchronous="OFF")
    with pytest.raises(ValueError, match="does not exist"):
        SQLiteTraceStore(tmp_path / "missing" / "a.db")
    with pytest.raises(ValueError, match="path"):
        SQLiteTraceStore("")
    with pytest.raises(ValueError, match="not supported"):
        open_store("mysql://x")
    with pytest.raises(ValueError, match="not supported"):
        open_store("sqlite:///")
    with pytest.raises(TypeError, match="url"):
        open_store(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dsn"):
        from harnessrl.traces.postgres import PostgresTraceStore

        PostgresTraceStore("sqlite:///x")


def test_memory_and_relative_urls(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mem = open_store("sqlite:///:memory:")
    assert mem.count_calls() == 0
    mem.close()
    monkeypatch.chdir(tmp_path)
    rel = open_store("sqlite:///rel.db")
    assert os.path.abspath(rel.path) == str(tmp_path / "rel.db")
    rel.close()


_WRITER = """
import os, sys, time
from harnessrl.traces.sqlite import SQLiteTraceStore
from harnessrl.traces.schema import CallRecord, EndpointKind
s = SQLiteTraceStore(sys.argv[1])
for i in range(50):
    s.add_call(CallRecord("k", -1, 0.0, 0.0, EndpointKind.COMPLETIONS, {"i": i}, None, (1,), (), None, "u", 0.0, 200))
    print(i, flush=True)
time.sleep(60)
"""


def test_committed_calls_survive_kill_9(tmp_path: pathlib.Path) -> None:
    db = tmp_path / "k.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(db)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    acknowledged = [proc.stdout.readline() for _ in range(50)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert acknowledged[-1].strip() == "49"
    conn = sqlite3.connect(db)  # the WAL is recovered on open
    assert conn.execute("SELECT COUNT(*) FROM calls").fetchone()[0] == 50
    conn.close()
    assert [c.request["i"] for c in SQLiteTraceStore(db).calls("k")] == list(range(50))


def test_background_checkpoint_keeps_the_wal_small(tmp_path: pathlib.Path) -> None:
    import time

    from harnessrl.traces.schema import CallRecord, EndpointKind

    db = tmp_path / "c.db"
    s = SQLiteTraceStore(db, background_checkpoint=True, checkpoint_interval_s=0.02)
    big = {"blob": "x" * 100_000}
    for _ in range(20):
        s.add_call(
            CallRecord("c", -1, 0.0, 0.0, EndpointKind.CHAT, big, None, (), (), None, "u", 0.0, 200)
        )
        time.sleep(0.06)
    # Checkpointed frames are reused, so the WAL stays far below the 2 MB written.
    s.add_call(
        CallRecord("c", -1, 0.0, 0.0, EndpointKind.CHAT, {}, None, (), (), None, "u", 0.0, 200)
    )
    assert os.path.getsize(str(db) + "-wal") < 2_000_000
    s.close()
    with SQLiteTraceStore(db) as again:
        assert again.count_calls("c") == 21


def _call(i: int) -> Any:
    from harnessrl.traces.schema import CallRecord, EndpointKind

    return CallRecord(
        "t", -1, 0.0, 0.0, EndpointKind.CHAT, {"i": i}, None, (), (), None, "u", 0.0, 200
    )


def test_try_add_calls_never_waits_for_a_lock(tmp_path: pathlib.Path) -> None:
    import threading

    from harnessrl.traces.sqlite import is_busy

    store = SQLiteTraceStore(tmp_path / "t.db")
    assert store.try_add_calls([_call(0)]) == [0]
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another connection (any process) holds the write lock
    t0 = time.monotonic()
    assert store.try_add_calls([_call(1), _call(2)]) is None
    assert time.monotonic() - t0 < 5  # did not sit out the 30 s busy timeout
    # A writer thread of this process waits for the lock (holding the store's own lock; it
    # waits rather than fails because the try put the busy timeout back) ...
    waiting = threading.Thread(target=store.add_call, args=(_call(1),))
    waiting.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    assert store.try_add_calls([_call(9)]) is None  # ... and the try does not queue behind it
    assert time.monotonic() - t0 < 5
    other.execute("COMMIT")
    other.close()
    waiting.join(30)
    assert store.try_add_calls([_call(2)]) == [2]
    assert [c.request["i"] for c in store.calls("t")] == [0, 1, 2]
    store.close()
    with pytest.raises(ValueError, match="closed"):
        store.try_add_calls([_call(3)])
    assert not is_busy(ValueError("database is locked"))


def test_busy_timeout_bounds_a_waiting_write(tmp_path: pathlib.Path) -> None:
    from harnessrl.traces.sqlite import is_busy

    with pytest.raises(ValueError, match="busy_timeout_s"):
        SQLiteTraceStore(tmp_path / "b.db", busy_timeout_s=0)
    store = SQLiteTraceStore(tmp_path / "b.db", busy_timeout_s=0.2)
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    t0 = time.monotonic()
    with pytest.raises(sqlite3.OperationalError) as err:
        store.add_call(_call(0))
    waited = time.monotonic() - t0
    other.execute("ROLLBACK")
    other.close()
    assert is_busy(err.value) and 0.15 < waited < 10
    assert store.add_call(_call(0)) == 0
    store.close()
