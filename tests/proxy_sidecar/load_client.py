"""Harness-like clients for the sidecar's load and crash tests, and the checks on what was stored.

Each call asks the distinct upstream (`distinct_upstream.answer`) for an answer derived from its own
content, so a response given to the wrong client, or a record stored with the wrong call, shows.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Callable

import aiohttp
import orjson
from distinct_upstream import answer

from harnessrl.traces.schema import CallRecord

# One fully received call: rollout, index, streamed, the bytes the client got.
Done = tuple[str, int, bool, bytes]


def content(rollout: str, i: int) -> str:
    return f"{rollout} call {i}"


def body(rollout: str, i: int, stream: bool) -> bytes:
    msg = {"role": "user", "content": content(rollout, i)}
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


def received_ids(raw: bytes, stream: bool) -> list[int]:
    """The completion token ids a client got, from a whole body or an SSE stream."""
    if not stream:
        return list(orjson.loads(raw)["choices"][0]["token_ids"])
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    events = [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    return [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]


def assert_own_answer(rec: CallRecord, text: str) -> None:
    """The store holds this call, whole, with the answer the upstream gave to exactly this
    request: its ids, logprobs and the response's text (a stream is stored assembled)."""
    ids, lps = answer(text)
    assert rec.ok, rec.error
    assert rec.request["messages"][0]["content"] == text
    assert list(rec.choices[0].token_ids) == ids and list(rec.choices[0].logprobs) == lps
    assert rec.response is not None
    (choice,) = rec.response["choices"]
    assert choice["message"]["content"] == "".join(f" t{t}" for t in ids)
    assert choice["finish_reason"] == "length"


async def load_until_killed(
    url: str, sidecar: subprocess.Popen[bytes], clients: int, after_s: float
) -> list[list[Done]]:
    """`clients` harnesses call back to back (every other call streamed) until the sidecar is
    killed with SIGKILL `after_s` seconds in; per client, the calls it fully received."""
    done: list[list[Done]] = [[] for _ in range(clients)]

    async def client(session: aiohttp.ClientSession, k: int) -> None:
        for i in range(10_000):
            stream = i % 2 == 1
            try:
                raw = await call(session, url, f"k{k}", i, stream)
            except (TimeoutError, aiohttp.ClientError):
                return  # the sidecar died under this call: it was not fully received
            done[k].append((f"k{k}", i, stream, raw))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        tasks = [asyncio.create_task(client(s, k)) for k in range(clients)]
        await asyncio.sleep(after_s)
        os.kill(sidecar.pid, signal.SIGKILL)
        await asyncio.gather(*tasks)
    sidecar.wait()
    return done


def check_no_call_lost(done: list[list[Done]], calls: Callable[[str], list[CallRecord]]) -> int:
    """Every call a client fully received is stored with its own whole answer; nothing else is,
    but the one call each client had in flight (committed before its last byte left); every
    stored call is whole, once, in the client's order. Returns the number of received calls."""
    for k, received in enumerate(done):
        stored = calls(f"k{k}")
        assert [c.seq for c in stored] == list(range(len(stored)))
        assert len(received) <= len(stored) <= len(received) + 1, (k, len(received), len(stored))
        for i, rec in enumerate(stored):
            assert_own_answer(rec, content(f"k{k}", i))
        for rollout, i, stream, raw in received:
            assert received_ids(raw, stream) == answer(content(rollout, i))[0]
    return sum(len(r) for r in done)
