"""Several upstreams: rollout stickiness, ejection and later re-admission, retries before the first
byte only, and both upstream client libraries."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVLLM, ServerThread, free_port

from proxy_sidecar.config import SidecarConfig
from proxy_sidecar.upstream import UpstreamPool

CHAT = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture
def three() -> Iterator[list[tuple[FakeVLLM, ServerThread]]]:
    fakes = [FakeVLLM(replay=False) for _ in range(3)]
    servers = [ServerThread(f.app).__enter__() for f in fakes]
    yield list(zip(fakes, servers, strict=True))
    for s in servers:
        if s.thread.is_alive():
            s.__exit__(None, None, None)


def test_rollouts_stick_to_one_upstream_and_spread_across_them(
    three: Any, make_sidecar: Any
) -> None:
    sc = make_sidecar(tuple(s.url for _, s in three))
    for k in range(12):
        for _ in range(3):
            assert httpx.post(sc.base(f"r{k}") + "/chat/completions", json=CHAT).status_code == 200
    used = set()
    for k in range(12):
        ups = {c.upstream for c in sc.store.calls(f"r{k}")}
        assert len(ups) == 1, f"rollout r{k} moved between upstreams: {ups}"
        used |= ups
    assert len(used) >= 2


def test_dead_upstream_is_ejected_and_calls_fail_over(three: Any, make_sidecar: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    sc = make_sidecar((dead, three[0][1].url), eject_s=60)
    for k in range(8):
        r = httpx.post(sc.base(f"f{k}") + "/chat/completions", json=CHAT)
        assert r.status_code == 200
    assert {c.upstream for k in range(8) for c in sc.store.calls(f"f{k}")} == {three[0][1].url}
    pool = sc.state.pool
    dead_up = next(u for u in pool.upstreams if u.url == dead)
    assert dead_up.failures == 1  # ejected after the first failure, not retried each call
    assert not dead_up.healthy(time.monotonic())


def test_retry_on_503_before_first_byte(three: Any, make_sidecar: Any) -> None:
    (f0, s0), (f1, s1) = three[0], three[1]
    sc = make_sidecar((s0.url, s1.url))
    f0.fail_statuses = [503]
    f1.fail_statuses = [503]
    r = httpx.post(sc.base("x") + "/chat/completions", json=CHAT)
    # Both answered 503 once; with 2 upstreams there is one retry, so the last 503 reaches the
    # client unchanged (an upstream's own error, not the sidecar's).
    assert r.status_code == 503 and r.headers["x-fake-upstream"] == "1"
    r = httpx.post(sc.base("x") + "/chat/completions", json=CHAT)
    assert r.status_code == 200
    calls = sc.store.calls("x")
    assert [c.status for c in calls] == [503, 200]
    assert calls[0].error.startswith("upstream HTTP 503")


def test_all_upstreams_down_gives_502_json_and_a_failed_record(make_sidecar: Any) -> None:
    sc = make_sidecar((f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"))
    r = httpx.post(sc.base("down") + "/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 502
    assert r.json()["error"]["type"] == "upstream_error"
    (rec,) = sc.store.calls("down")
    assert rec.status == 502 and rec.error.startswith("upstream: no upstream answered")
    models = httpx.get(sc.base("down") + "/models")
    assert models.status_code == 502


def test_ejected_upstream_is_tried_again_later() -> None:
    pool = UpstreamPool(SidecarConfig(upstreams=("http://a:1", "http://b:1/v1"), eject_s=0.05))
    assert {u.url for u in pool.upstreams} == {"http://a:1", "http://b:1"}
    first = pool.candidates("roll")[0]
    pool.eject(first)
    assert pool.candidates("roll")[0] is not first
    assert pool.candidates("roll")[-1] is first  # kept as a last resort
    time.sleep(0.06)
    assert pool.candidates("roll")[0] is first  # back, and the rollout sticks to it again


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_upstream_silent_before_its_headers_gives_504(
    fake: Any, make_sidecar: Any, client: str
) -> None:
    fake[0].delay_s = 1.0
    sc = make_sidecar((fake[1].url,), read_timeout_s=0.2, retries=0, client=client)
    r = httpx.post(sc.base("slow") + "/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 504
    assert r.json()["error"] == {
        "message": r.json()["error"]["message"],
        "type": "upstream_timeout",
        "param": None,
        "code": 504,
    }
    (rec,) = sc.store.calls("slow")
    assert rec.status == 504 and rec.error.startswith("upstream:") and not rec.ok


def stalling_upstream(stream: bool) -> Any:
    """Sends its headers and a first piece of the body, then goes silent until the caller leaves:
    a server stuck mid-answer."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if stream:
            headers = [(b"content-type", b"text/event-stream")]
            first = b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
        else:
            headers = [(b"content-type", b"application/json"), (b"content-length", b"100")]
            first = b'{"choices"'
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": first, "more_body": True})
        await asyncio.wait_for(receive(), 30)  # returns when the sidecar hangs up

    return app


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_upstream_silent_mid_answer_gives_504(make_sidecar: Any, client: str) -> None:
    with ServerThread(stalling_upstream(stream=False)) as up:
        sc = make_sidecar((up.url,), read_timeout_s=0.3, retries=0, client=client)
        r = httpx.post(sc.base("stall") + "/chat/completions", json=CHAT, timeout=10)
        models = httpx.get(sc.base("stall") + "/models", timeout=10)
    assert r.status_code == 504 and r.json()["error"]["type"] == "upstream_timeout"
    assert "timed out" in r.json()["error"]["message"]
    assert models.status_code == 504 and models.json()["error"]["code"] == 504
    (rec,) = sc.store.calls("stall")
    assert rec.status == 504 and rec.error.startswith("upstream:")


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_upstream_silent_mid_stream_ends_the_stream_with_a_504_event(
    make_sidecar: Any, client: str
) -> None:
    with ServerThread(stalling_upstream(stream=True)) as up:
        sc = make_sidecar((up.url,), read_timeout_s=0.3, retries=0, client=client)
        body = {**CHAT, "stream": True}
        r = httpx.post(sc.base("st") + "/chat/completions", json=body, timeout=10)
    assert r.status_code == 200 and r.text.startswith('data: {"choices"')
    last = json.loads(r.text.strip().rsplit("data: ", 1)[-1])
    assert last["error"]["code"] == 504 and "timed out" in last["error"]["message"]
    assert "[DONE]" not in r.text
    (rec,) = sc.store.calls("st")
    assert not rec.ok and rec.error.startswith("upstream:")


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_both_client_libraries_proxy_and_capture(fake: Any, make_sidecar: Any, client: str) -> None:
    sc = make_sidecar((fake[1].url,), client=client)
    plain = httpx.post(sc.base("c") + "/chat/completions", json=CHAT).json()
    streamed = httpx.post(sc.base("c") + "/chat/completions", json={**CHAT, "stream": True})
    assert streamed.text.endswith("data: [DONE]\n\n")
    assert httpx.get(sc.base("c") + "/models").json()["data"][0]["id"] == "smol"
    calls = sc.store.calls("c")
    assert [c.ok for c in calls] == [True, True]
    assert list(calls[0].choices[0].token_ids) == plain["choices"][0]["token_ids"]


def test_pool_before_start_fails_cleanly() -> None:
    pool = UpstreamPool(SidecarConfig(upstreams=("http://127.0.0.1:9",), retries=0))

    async def go() -> None:
        await pool.request("r", "GET", "/v1/models", [], None)

    with pytest.raises(Exception, match="no upstream answered"):
        asyncio.run(go())


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_a_connection_dropped_under_the_request_is_retried_once_on_the_same_upstream(
    client: str,
) -> None:
    """Like a keep-alive connection the server closed while idle: the first connection is cut
    after the request arrives; the same upstream is asked again on a fresh one, not ejected."""
    seen = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        seen.append(1)
        if len(seen) > 1:
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}"
            )
            await writer.drain()
        writer.close()

    async def go() -> tuple[int, bytes, UpstreamPool]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        config = SidecarConfig(upstreams=(f"http://127.0.0.1:{port}",), client=client, retries=0)
        pool = UpstreamPool(config)
        await pool.start()
        _, resp = await pool.request("r", "POST", "/v1/chat/completions", [], b"{}")
        body = await resp.read()
        await pool.close()
        server.close()
        return resp.status, body, pool

    status, body, pool = asyncio.run(go())
    assert (status, body) == (200, b"{}") and len(seen) == 2
    assert pool.stale_retries == 1 and pool.upstreams[0].failures == 0
