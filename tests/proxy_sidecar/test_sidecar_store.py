"""The sidecar and its SQLite store: another process holding the write lock never stalls the event
loop, a lock held past the busy timeout fails the call cleanly, and WAL checkpoints run on the
helper thread of a store the sidecar opened itself."""

from __future__ import annotations

import contextlib
import os
import pathlib
import sqlite3
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
from fake_vllm import ServerThread

from harnessrl.traces.sqlite import SQLiteTraceStore
from proxy_sidecar.app import build_app
from proxy_sidecar.config import SidecarConfig

# Another process takes the database's write lock and keeps it until told to let go.
_HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("COMMIT")
"""


def chat(content: str, stream: bool = False) -> dict[str, Any]:
    msg = {"role": "user", "content": content}
    return {"model": "smol", "messages": [msg], "max_tokens": 3, "stream": stream}


def wait_until(cond: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def hold_lock(db: str) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, db],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    return holder


def release(holder: subprocess.Popen[str]) -> None:
    assert holder.stdin is not None
    holder.stdin.write("\n")
    holder.stdin.flush()
    holder.wait(timeout=30)


def test_a_foreign_write_lock_never_stalls_the_event_loop(fake: Any, make_sidecar: Any) -> None:
    sc = make_sidecar((fake[1].url,))
    assert httpx.post(sc.base("warm") + "/chat/completions", json=chat("warm")).status_code == 200
    holder = hold_lock(sc.store.path)
    got: dict[int, httpx.Response] = {}

    def harness(k: int) -> None:
        body = chat(f"locked call {k}", stream=k % 2 == 1)
        got[k] = httpx.post(sc.base(f"lock{k}") + "/chat/completions", json=body, timeout=60)

    workers = [threading.Thread(target=harness, args=(k,)) for k in range(4)]
    try:
        for w in workers:
            w.start()
        wait_until(lambda: len(fake[0].requests) == 5)  # the warm-up call and these four
        # The loop keeps serving while the other process holds the lock for seconds (with
        # commits on the loop, waiting for the lock, these would time out).
        held = time.monotonic()
        while time.monotonic() - held < 2.0:
            assert httpx.get(sc.url + "/health", timeout=5).json()["in_flight"] == 4
        # Every call has its response in hand and waits on the writer thread for its commit.
        assert sc.state.recorder.handoffs == 4
        assert "sidecar_in_flight 4.0" in httpx.get(sc.url + "/metrics", timeout=5).text
        # No response left before its record was durable. (Read through a connection of our
        # own: the store's, in this process, is the writer thread's while that waits.)
        with contextlib.closing(sqlite3.connect(sc.store.path)) as reader:
            assert reader.execute("SELECT COUNT(*) FROM calls").fetchone()[0] == 1
        assert got == {}
    finally:
        release(holder)
    for w in workers:
        w.join(60)
    assert sorted(got) == [0, 1, 2, 3] and all(r.status_code == 200 for r in got.values())
    for k, resp in got.items():
        (rec,) = sc.store.calls(f"lock{k}")
        assert rec.ok and rec.request["messages"][0]["content"] == f"locked call {k}"
        if k % 2 == 0:
            assert list(rec.choices[0].token_ids) == resp.json()["choices"][0]["token_ids"]
        else:
            assert resp.text.endswith("data: [DONE]\n\n")
    # The writer thread caught up: later commits run inline again.
    before = sc.state.recorder.handoffs
    assert httpx.post(sc.base("after") + "/chat/completions", json=chat("after")).status_code == 200
    assert sc.state.recorder.handoffs == before and sc.store.count_calls("after") == 1


def test_a_lock_held_past_the_busy_timeout_fails_the_call_with_503(
    fake: Any, make_sidecar: Any, tmp_path: pathlib.Path
) -> None:
    store = SQLiteTraceStore(tmp_path / "busy.db", busy_timeout_s=0.3)
    sc = make_sidecar((fake[1].url,), store=store)
    holder = hold_lock(store.path)
    try:
        r = httpx.post(sc.base("b") + "/chat/completions", json=chat("never stored"), timeout=30)
        s = httpx.post(sc.base("b") + "/chat/completions", json=chat("s", stream=True), timeout=30)
        assert httpx.get(sc.url + "/health", timeout=5).status_code == 200
    finally:
        release(holder)
    assert r.status_code == 503 and "trace store" in r.json()["error"]["message"]
    assert "[DONE]" not in s.text and "trace store could not record" in s.text
    assert "sidecar_store_errors_total 2.0" in httpx.get(sc.url + "/metrics").text
    assert store.count_calls() == 0
    assert httpx.post(sc.base("b") + "/chat/completions", json=chat("ok")).status_code == 200


def test_its_own_sqlite_store_checkpoints_on_a_helper_thread(
    fake: Any, tmp_path: pathlib.Path
) -> None:
    """Commits only append to the WAL; the helper thread copies the frames into the database file
    (SQLite's own autocheckpoint would not before the WAL held 1000 pages, about 4 MB)."""
    db = tmp_path / "own.db"
    config = SidecarConfig(upstreams=(fake[1].url,), store=f"sqlite:///{db}", log_calls=False)
    with ServerThread(build_app(config)) as sc:
        start = os.path.getsize(db)
        for i in range(20):
            body = {**chat(f"{i}"), "metadata": {"pad": "x" * 4000}}  # stored with the call
            assert httpx.post(sc.url + "/v1/chat/completions", json=body).status_code == 200
        assert os.path.getsize(str(db) + "-wal") > 20 * 4000  # the calls went to the WAL first
        wait_until(lambda: os.path.getsize(db) > start + 20 * 4000, timeout_s=20)
    with SQLiteTraceStore(db) as store:
        assert store.count_calls("default") == 20
