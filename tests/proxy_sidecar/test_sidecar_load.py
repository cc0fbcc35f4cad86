"""Acceptance: load (256 concurrent clients x 20 calls) and kill -9 under load; no call is lost."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import time
from collections import Counter
from typing import Any

import aiohttp
import orjson
from sidecar_proc import start_sidecar, start_upstream, stop

from harnessrl.traces.sqlite import SQLiteTraceStore


def body(rollout: str, i: int, stream: bool) -> bytes:
    msg = {"role": "user", "content": f"{rollout} call {i}"}
    return orjson.dumps({"model": "smol", "messages": [msg], "max_tokens": 4, "stream": stream})


async def call(
    session: aiohttp.ClientSession, url: str, rollout: str, i: int, stream: bool
) -> bytes:
    async with session.post(
        f"{url}/rollouts/{rollout}/v1/chat/completions",
        data=body(rollout, i, stream),
        headers={"content-type": "application/json"},
    ) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
        return raw


def test_256_clients_x_20_calls_all_stored_once(tmp_path: pathlib.Path) -> None:
    up, up_url = start_upstream(fixed=True)
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
    contents = Counter()
    for k in range(clients):
        calls = store.calls(f"c{k}")
        assert [c.seq for c in calls] == list(range(per))
        assert all(c.ok for c in calls), [c.error for c in calls if not c.ok]
        for i, c in enumerate(calls):
            contents[c.request["messages"][0]["content"]] += 1
            if (k + i) % 2:  # non-streaming: the stored ids are the ones the client got
                got = orjson.loads(received[k][i])
                assert list(c.choices[0].token_ids) == got["choices"][0]["token_ids"]
    assert len(contents) == clients * per and set(contents.values()) == {1}
    print(f"{clients * per} calls in {elapsed:.1f}s")
    store.close()


def test_kill_9_under_load_loses_no_fully_received_call(tmp_path: pathlib.Path) -> None:
    db = tmp_path / "crash.db"
    up, up_url = start_upstream(fixed=True)
    sc, url = start_sidecar(up_url, db)
    done: list[tuple[str, int, bool, bytes]] = []

    async def client(session: aiohttp.ClientSession, k: int) -> None:
        for i in range(10_000):
            stream = i % 2 == 1
            try:
                raw = await call(session, url, f"k{k}", i, stream)
            except (TimeoutError, aiohttp.ClientError, AssertionError):
                return  # the sidecar died under this call: it was not fully received
            if stream and not raw.endswith(b"data: [DONE]\n\n"):
                return
            done.append((f"k{k}", i, stream, raw))

    async def main() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            tasks = [asyncio.create_task(client(s, k)) for k in range(32)]
            await asyncio.sleep(1.5)
            os.kill(sc.pid, signal.SIGKILL)
            await asyncio.gather(*tasks)

    try:
        asyncio.run(main())
        sc.wait()
        sc, url = start_sidecar(up_url, db)  # restart on the same store: it serves again
        asyncio.run(_one_call(url))
    finally:
        stop(sc)
        stop(up)
    assert len(done) > 20
    store = SQLiteTraceStore(db)
    stored: dict[tuple[str, str], Any] = {}
    for rollout in {r for r, *_ in done}:
        for c in store.calls(rollout):
            stored[(rollout, c.request["messages"][0]["content"])] = c
    for rollout, i, stream, raw in done:
        rec = stored.get((rollout, f"{rollout} call {i}"))
        assert rec is not None, f"fully received call {rollout}/{i} missing after kill -9"
        assert rec.ok
        if not stream:
            assert list(rec.choices[0].token_ids) == orjson.loads(raw)["choices"][0]["token_ids"]
    assert store.count_calls("after-restart") == 1
    store.close()


async def _one_call(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        await call(s, url, "after-restart", 0, False)
