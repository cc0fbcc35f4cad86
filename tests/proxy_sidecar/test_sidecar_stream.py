"""Streaming capture: the SSE tee on any chunking, [DONE] held until the record is stored,
mid-stream upstream failure, client disconnect, and store or capture failures."""

from __future__ import annotations

import itertools
import json
import sqlite3
import time
from typing import Any

import httpx
import openai
import pytest
from fake_vllm import load_exchanges
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.traces.parse import parse_response
from harnessrl.traces.schema import EndpointKind
from harnessrl.traces.sqlite import SQLiteTraceStore
from proxy_sidecar.capture import SSETee

STREAMS = [r for r in load_exchanges() if r["request"].get("stream")]
CHAT = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}


@settings(max_examples=60, deadline=None)
@given(
    row=st.sampled_from(STREAMS),
    cuts=st.lists(st.integers(min_value=1, max_value=6000), max_size=40),
    crlf=st.booleans(),
)
def test_tee_forwards_every_byte_and_holds_done(
    row: dict[str, Any], cuts: list[int], crlf: bool
) -> None:
    raw = row["response_raw"].encode()
    if crlf:
        raw = raw.replace(b"\n", b"\r\n")
    kind = EndpointKind.CHAT if "chat" in row["path"] else EndpointKind.COMPLETIONS
    tee = SSETee(kind)
    points = sorted({c % len(raw) for c in cuts} | {0, len(raw)})
    forwarded = b"".join(tee.feed(raw[a:b]) for a, b in itertools.pairwise(points))
    assert b"[DONE]" not in forwarded
    held = tee.finish()
    assert forwarded + held == raw and held.strip().endswith(b"data: [DONE]")
    assert tee.capture_error is None
    events = [
        json.loads(b[6:]) for b in row["response_raw"].split("\n\n") if b.startswith("data: {")
    ]
    _, choices = parse_response(kind, tee.assembler.body())
    assert list(choices[0].token_ids) == [
        t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])
    ]


def test_tee_reports_garbage_without_stopping_the_stream() -> None:
    tee = SSETee(EndpointKind.CHAT)
    assert tee.feed(b"data: {not json\n\n: comment\n\n") == b"data: {not json\n\n: comment\n\n"
    assert tee.capture_error is not None and tee.capture_error.startswith("capture:")
    assert tee.feed(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"  # parsing stopped: nothing held


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_upstream_failure_mid_stream_is_recorded_and_surfaced(
    fake: Any, make_sidecar: Any, client: str
) -> None:
    sidecar = make_sidecar((fake[1].url,), client=client)
    fake[0].drop_after_chunks = 3
    r = httpx.post(sidecar.base("mid") + "/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200 and "[DONE]" not in r.text
    assert '"error"' in r.text.rsplit("data: ", 1)[-1]
    (rec,) = sidecar.store.calls("mid")
    assert not rec.ok and rec.error.startswith("upstream:")
    client = openai.OpenAI(base_url=sidecar.base("mid"), api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        list(client.chat.completions.create(model="smol", messages=CHAT["messages"], stream=True))


def test_client_disconnect_closes_upstream_and_is_recorded(fake: Any, sidecar: Any) -> None:
    fake[0].delay_s = 0.05
    with httpx.stream(
        "POST",
        sidecar.base("gone") + "/chat/completions",
        json={**CHAT, "max_tokens": 100, "stream": True},
    ) as r:
        next(r.iter_raw())
    deadline = time.monotonic() + 10
    while sidecar.store.count_calls("gone") == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    (rec,) = sidecar.store.calls("gone")
    assert rec.error == "client disconnected" and not rec.ok
    assert rec.latency_ms < 4000  # did not wait for the 5 s, 100-token stream to finish
    while sidecar.state.in_flight:  # the handler leaves just after its record is committed
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_missing_token_ids_is_a_capture_error_but_the_response_passes(
    fake: Any, sidecar: Any
) -> None:
    fake[0].honor_token_ids = False
    plain = httpx.post(sidecar.base("cap") + "/chat/completions", json=CHAT)
    streamed = httpx.post(sidecar.base("cap") + "/chat/completions", json={**CHAT, "stream": True})
    assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"]
    assert streamed.text.endswith("data: [DONE]\n\n")
    calls = sidecar.store.calls("cap")
    assert all(c.error.startswith("capture:") and "return_token_ids" in c.error for c in calls)
    assert "sidecar_capture_errors_total 2.0" in httpx.get(sidecar.url + "/metrics").text


class BrokenStore(SQLiteTraceStore):
    def add_calls(self, calls: list[Any]) -> list[int]:
        raise sqlite3.OperationalError("database or disk is full")

    def add_call(self, call: Any) -> int:
        raise sqlite3.OperationalError("database or disk is full")


def test_store_failure_never_delivers_an_unrecorded_response(
    fake: Any, make_sidecar: Any, tmp_path: Any
) -> None:
    sc = make_sidecar((fake[1].url,), store=BrokenStore(tmp_path / "broken.db"))
    r = httpx.post(sc.base("s") + "/chat/completions", json=CHAT)
    assert r.status_code == 503 and "trace store" in r.json()["error"]["message"]
    s = httpx.post(sc.base("s") + "/chat/completions", json={**CHAT, "stream": True})
    assert "[DONE]" not in s.text and "trace store" in s.text
    assert "sidecar_store_errors_total 2.0" in httpx.get(sc.url + "/metrics").text


class ThreadedStore(SQLiteTraceStore):
    inline_writes = False  # as a network database: commits on the writer thread


def test_writer_thread_path_for_network_stores(fake: Any, make_sidecar: Any, tmp_path: Any) -> None:
    sc = make_sidecar((fake[1].url,), store=ThreadedStore(tmp_path / "t.db"))
    for stream in (False, True, False):
        assert (
            httpx.post(
                sc.base("w") + "/chat/completions", json={**CHAT, "stream": stream}
            ).status_code
            == 200
        )
    assert [c.seq for c in sc.store.calls("w")] == [0, 1, 2]
    assert sc.state.recorder.commits >= 1


def test_sidecar_on_postgresql(fake: Any, make_sidecar: Any, pg_dsn: str) -> None:
    from harnessrl.traces.postgres import PostgresTraceStore

    store = PostgresTraceStore(pg_dsn)
    sc = make_sidecar((fake[1].url,), store=store)
    client = openai.OpenAI(base_url=sc.base("pg"), api_key="x", max_retries=0)
    resp = client.chat.completions.create(model="smol", messages=CHAT["messages"], n=2)
    list(client.chat.completions.create(model="smol", messages=CHAT["messages"], stream=True))
    calls = store.calls("pg")
    assert [c.seq for c in calls] == [0, 1] and all(c.ok for c in calls)
    assert [list(c.token_ids) for c in calls[0].choices] == [c.token_ids for c in resp.choices]
    store.close()
