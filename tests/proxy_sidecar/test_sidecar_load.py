"""Acceptance: load (256 concurrent clients x 20 calls, each with its own answer) and kill -9 under
load; no call is lost or mixed up; concurrent large bodies stay within the memory budget."""

from __future__ import annotations

import asyncio
import pathlib
import time

import aiohttp
import orjson
from distinct_upstream import answer
from load_client import (
    assert_own_answer,
    call,
    check_no_call_lost,
    content,
    load_until_killed,
    received_ids,
)
from sidecar_proc import start_sidecar, start_upstream, stop

from harnessrl.traces.sqlite import SQLiteTraceStore


def test_256_clients_x_20_calls_each_get_and_store_their_own_answer(
    tmp_path: pathlib.Path,
) -> None:
    up, up_url = start_upstream(distinct=True)
    sc, url = start_sidecar(up_url, tmp_path / "load.db")
    clients, per = 256, 20

    async def client(session: aiohttp.ClientSession, k: int) -> list[bytes]:
        return [await call(session, url, f"c{k}", i, stream=(k + i) % 2 == 0) for i in range(per)]

    async def main() -> list[list[bytes]]:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(
            connector=conn, timeout=aiohttp.ClientTimeout(total=300)
        ) as s:
            return await asyncio.gather(*(client(s, k) for k in range(clients)))

    try:
        t0 = time.monotonic()
        received = asyncio.run(main())
        elapsed = time.monotonic() - t0
    finally:
        stop(sc)
        stop(up)
    store = SQLiteTraceStore(tmp_path / "load.db")
    assert store.count_calls() == clients * per
    for k in range(clients):
        calls = store.calls(f"c{k}")
        assert [c.seq for c in calls] == list(range(per))  # once each, in the client's order
        for i, c in enumerate(calls):
            text = content(f"c{k}", i)
            assert_own_answer(c, text)
            assert received_ids(received[k][i], stream=(k + i) % 2 == 0) == answer(text)[0]
    print(f"{clients * per} calls in {elapsed:.1f}s")
    store.close()


def test_kill_9_under_load_loses_no_fully_received_call(tmp_path: pathlib.Path) -> None:
    db = tmp_path / "crash.db"
    up, up_url = start_upstream(distinct=True)
    sc, url = start_sidecar(up_url, db)
    try:
        done = asyncio.run(load_until_killed(url, sc, clients=32, after_s=1.5))
        sc, url = start_sidecar(up_url, db)  # restart on the same store: it serves again
        asyncio.run(_one_call(url))
    finally:
        stop(sc)
        stop(up)
    store = SQLiteTraceStore(db)
    assert check_no_call_lost(done, store.calls) > 20
    assert store.count_calls("after-restart") == 1
    store.close()


async def _one_call(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        await call(s, url, "after-restart", 0, False)


def _peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def test_concurrent_large_bodies_stay_within_the_memory_budget(tmp_path: pathlib.Path) -> None:
    """16 clients send 8 MB each at once to a sidecar with a 16 MiB budget. Unbounded, it would
    hold all 128 MB, a few copies of each (body, parsed, re-encoded, recorded: 258 MiB measured);
    with the budget at most 16 MiB of bodies are in flight, so the peak stays within a few copies
    of that (48 MiB measured; the bound is 6 copies), and the calls past it get 503."""
    budget = 16 * 1024 * 1024
    up, up_url = start_upstream(distinct=True)
    sc, url = start_sidecar(
        up_url, tmp_path / "mem.db", "--max-body-bytes", str(budget // 2),
        "--max-buffered-bytes", str(budget),
    )  # fmt: skip
    big = "x" * (8 * 1000 * 1000)

    async def one(session: aiohttp.ClientSession, k: int) -> int:
        msg = {"role": "user", "content": f"{k} {big}"}
        data = orjson.dumps({"model": "smol", "messages": [msg], "max_tokens": 2})
        async with session.post(f"{url}/rollouts/m{k}/v1/chat/completions", data=data) as r:
            await r.read()
            assert r.status == 503 or r.status == 200, r.status
            if r.status == 503:
                assert r.headers["retry-after"] == "1"
            return r.status

    async def main() -> list[int]:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            return await asyncio.gather(*(one(s, k) for k in range(16)))

    try:
        start = _peak_rss_bytes(sc.pid)
        statuses = asyncio.run(main())
        peak = _peak_rss_bytes(sc.pid)
    finally:
        stop(sc)
        stop(up)
    assert 200 in statuses and 503 in statuses  # the budget was reached and calls still served
    assert peak - start < 6 * budget, f"peak grew {(peak - start) / 2**20:.0f} MiB"
    with SQLiteTraceStore(tmp_path / "mem.db") as store:
        assert store.count_calls() == statuses.count(200)
