"""HTTP edge behaviour: limits, malformed input, unknown routes, health, metrics, the call log."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

import httpx
import orjson
import pytest

from harnessrl.traces.schema import RolloutRecord
from proxy_sidecar.budget import BodyBudget
from proxy_sidecar.control import read_body
from proxy_sidecar.errors import Unavailable
from proxy_sidecar.metrics import Metrics

CHAT = {
    "model": "smol",
    "messages": [{"role": "user", "content": "a secret prompt"}],
    "max_tokens": 3,
}


def test_body_limit_gives_413_with_and_without_content_length(fake: Any, make_sidecar: Any) -> None:
    sc = make_sidecar((fake[1].url,), max_body_bytes=1000)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}
    r = httpx.post(sc.base("b") + "/chat/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413

    def chunks() -> Any:
        for _ in range(4):
            yield b" " * 400

    r = httpx.post(sc.base("b") + "/chat/completions", content=chunks())
    assert r.status_code == 413
    assert httpx.post(sc.base("b") + "/chat/completions", json=CHAT).status_code == 200
    assert sc.store.count_calls() == 1


@pytest.mark.parametrize(
    ("method", "path", "content", "status"),
    [
        ("POST", "/v1/chat/completions", b"{nope", 400),
        ("POST", "/v1/chat/completions", b"[1, 2]", 400),
        ("POST", "/v1/completions", b"", 400),
        ("POST", "/v1/embeddings", b"{}", 404),
        ("GET", "/", b"", 404),
        ("GET", "/v1/chat/completions", b"", 405),
        ("DELETE", "/control/pause", b"", 405),
        ("POST", "/rollouts/" + "r" * 300 + "/v1/chat/completions", json.dumps(CHAT).encode(), 400),
        ("POST", "/rollouts/a%09b/v1/chat/completions", json.dumps(CHAT).encode(), 400),
    ],
)
def test_bad_requests_get_openai_style_4xx(
    sidecar: Any, method: str, path: str, content: bytes, status: int
) -> None:
    r = httpx.request(method, sidecar.url + path, content=content)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == status and isinstance(err["message"], str) and err["type"]
    assert sidecar.store.count_calls() == 0


def test_buffered_bodies_share_one_budget_and_past_it_get_503_retry_after(
    fake: Any, make_sidecar: Any
) -> None:
    fake[0].delay_s = 1.5  # admitted calls stay in flight, holding their bodies
    sc = make_sidecar((fake[1].url,), max_body_bytes=40_000, max_buffered_bytes=100_000)
    big = [  # ~30 kB bodies (the padding is not part of the prompt)
        {
            **CHAT,
            "messages": [{"role": "user", "content": f"{k}"}],
            "metadata": {"pad": "x" * 30_000},
        }
        for k in range(4)
    ]
    got: dict[int, httpx.Response] = {}

    def harness(k: int) -> None:
        got[k] = httpx.post(sc.base(f"buf{k}") + "/chat/completions", json=big[k], timeout=30)

    workers = [threading.Thread(target=harness, args=(k,)) for k in range(3)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 20
    while sc.state.in_flight < 3:  # three bodies of ~30 kB held: no room for a fourth
        assert time.monotonic() < deadline
        time.sleep(0.01)

    def chunked() -> Any:  # no Content-Length: refused part-way through the body
        raw = json.dumps(big[3]).encode()
        for i in range(0, len(raw), 4096):
            yield raw[i : i + 4096]

    for content in (json.dumps(big[3]).encode(), chunked()):
        r = httpx.post(sc.base("buf3") + "/chat/completions", content=content, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "service_unavailable"
        assert "--max-buffered-bytes" in r.json()["error"]["message"]
    for w in workers:
        w.join(30)
    fake[0].delay_s = 0.0
    assert [got[k].status_code for k in range(3)] == [200, 200, 200]
    budget = sc.state.budget
    while budget.held:  # given back as each handler returns, just after its response went out
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert 90_000 < budget.peak <= 100_000
    assert "sidecar_budget_refusals_total 2.0" in httpx.get(sc.url + "/metrics").text
    r = httpx.post(sc.base("buf3") + "/chat/completions", json=big[3], timeout=30)
    assert r.status_code == 200  # room again once the others finished
    assert [sc.store.count_calls(f"buf{k}") for k in range(4)] == [1, 1, 1, 1]


@pytest.mark.parametrize("pieces", [[b"a" * 60, b"b" * 60], [b"a" * 60, b"b" * 60, b"c" * 60]])
def test_a_refused_body_is_read_to_its_end_and_no_further(pieces: list[bytes]) -> None:
    """Past the budget the rest of the body is dropped, so the client can read its 503; a
    refusal on the body's last piece must not wait for more (the client would wait forever)."""
    messages = [
        {"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
        for i, p in enumerate(pieces)
    ]

    async def receive() -> dict[str, Any]:
        assert messages, "read past the end of the body"
        return messages.pop(0)

    budget = BodyBudget(100, Metrics())
    with pytest.raises(Unavailable):
        asyncio.run(read_body({"headers": []}, receive, 1000, budget))
    assert messages == [] and budget.held == 0


def nested(depth: int) -> Any:
    value: Any = {"type": "object"}
    for _ in range(depth - 1):
        value = {"properties": value}
    return value


def test_deeply_nested_json_is_forwarded_or_refused_never_a_5xx(fake: Any, sidecar: Any) -> None:
    """orjson parses 1024 levels but re-encodes 254; the trace store encodes the same way. So a
    request the sidecar could not record is refused with a 400 before it reaches the upstream,
    and anything shallower goes through and is recorded."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": nested(250)}}]
    ok = httpx.post(sidecar.base("deep") + "/chat/completions", json={**CHAT, "tools": tools})
    assert ok.status_code == 200
    (rec,) = sidecar.store.calls("deep")
    assert rec.ok and rec.request["tools"] == tools  # stored whole
    forwarded = len(fake[0].requests)
    for depth, why in ((300, "254 levels"), (1000, "254 levels"), (1100, "not valid JSON")):
        # Written out by hand: JSON encoders have nesting limits of their own.
        schema = '{"properties": ' * (depth - 1) + '{"type": "object"}' + "}" * (depth - 1)
        tool = '{"type": "function", "function": {"name": "f", "parameters": ' + schema + "}}"
        raw = json.dumps(CHAT)[:-1] + ', "tools": [' + tool + "]}"
        r = httpx.post(sidecar.base("deep") + "/chat/completions", content=raw)
        assert r.status_code == 400, (depth, r.text[:200])
        assert why in r.json()["error"]["message"] and r.json()["error"]["code"] == 400
    assert len(fake[0].requests) == forwarded and sidecar.store.count_calls("deep") == 1
    sidecar.store.create_rollout(RolloutRecord("deep", task_id="t", group_id="g"))
    finish = '{"state": "succeeded", "info": ' + '{"a": ' * 300 + "1" + "}" * 301
    r = httpx.post(sidecar.url + "/rollouts/deep/finish", content=finish)
    assert r.status_code == 400 and "254 levels" in r.json()["error"]["message"]


def test_health_and_metrics(sidecar: Any) -> None:
    health = httpx.get(sidecar.url + "/health").json()
    assert health["status"] == "ok" and health["paused"] is False and len(health["upstreams"]) == 1
    httpx.post(sidecar.base("m") + "/chat/completions", json=CHAT)
    httpx.post(
        sidecar.base("m") + "/completions", json={"model": "smol", "prompt": "x", "stream": True}
    )
    text = httpx.get(sidecar.url + "/metrics").text
    assert 'sidecar_calls_total{route="chat",status="200"} 1.0' in text
    assert 'sidecar_calls_total{route="completions",status="200"} 1.0' in text
    assert 'sidecar_call_latency_seconds_count{route="chat"} 1.0' in text
    assert "sidecar_in_flight 0.0" in text and "sidecar_store_write_seconds_count 2.0" in text


def test_one_log_line_per_call_without_content(
    fake: Any, make_sidecar: Any, caplog: pytest.LogCaptureFixture
) -> None:
    sc = make_sidecar((fake[1].url,), log_calls=True)
    with caplog.at_level(logging.INFO, logger="proxy_sidecar.calls"):
        httpx.post(sc.base("log") + "/chat/completions", json=CHAT)
        httpx.post(sc.base("log") + "/chat/completions", json={**CHAT, "stream": True, "n": 2})
    lines = [r.getMessage() for r in caplog.records if r.name == "proxy_sidecar.calls"]
    assert len(lines) == 2
    assert all("secret" not in line and " w" not in line for line in lines)
    first, second = (json.loads(line) for line in lines)
    assert first["rollout"] == "log" and first["seq"] == 0 and first["status"] == 200
    assert first["completion_tokens"] == 3 and first["prompt_tokens"] > 0 and first["error"] is None
    assert second["stream"] is True and second["choices"] == 2 and second["completion_tokens"] == 6


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_query_string_and_headers_reach_upstream(fake: Any, make_sidecar: Any, client: str) -> None:
    sc = make_sidecar((fake[1].url,), client=client)
    harness_headers = {
        "x-trace": "abc",
        "authorization": "Bearer sk-harness",  # the harness's own key: the upstream's business
        "content-type": "text/plain",  # what the sidecar sends is JSON, whatever this says
        "accept-encoding": "gzip",  # the sidecar reads the body, so it asks for identity
        "keep-alive": "timeout=99",
        "proxy-connection": "keep-alive",
        "te": "trailers",
    }
    r = httpx.post(
        sc.base("h") + "/chat/completions?x=1&y=two%20words",
        content=json.dumps(CHAT),
        headers=harness_headers,
    )
    assert r.status_code == 200 and r.headers["x-fake-upstream"] == "1"  # upstream's own header
    assert int(r.headers["content-length"]) == len(r.content)
    (seen,) = fake[0].seen
    assert seen["query"] == "x=1&y=two%20words"
    sent: dict[bytes, list[bytes]] = {}
    for name, value in seen["headers"]:
        sent.setdefault(name, []).append(value)
    assert sent[b"x-trace"] == [b"abc"] and sent[b"authorization"] == [b"Bearer sk-harness"]
    assert sent[b"content-type"] == [b"application/json"]
    assert sent[b"host"] == [fake[1].url.removeprefix("http://").encode()]
    (length,) = sent[b"content-length"]  # recomputed for the rewritten body
    assert int(length) == len(orjson.dumps(fake[0].requests[0]))
    for hop in (b"keep-alive", b"proxy-connection", b"te"):
        assert hop not in sent, hop
    assert sent[b"accept-encoding"] == [b"identity"]


async def truncating_upstream(scope: Any, receive: Any, send: Any) -> None:
    """Promises 100 bytes, sends 10, then dies: a server crashing mid-response."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", b"100"), (b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": b'{"choices"', "more_body": True})
    raise ConnectionAbortedError("upstream crashed mid-response")


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_upstream_dying_mid_body_gives_502_and_a_failed_record(
    make_sidecar: Any, client: str
) -> None:
    from fake_vllm import ServerThread

    with ServerThread(truncating_upstream) as up:
        sc = make_sidecar((up.url,), client=client, retries=0)
        r = httpx.post(sc.base("t") + "/chat/completions", json=CHAT)
        assert r.status_code == 502 and "failed while answering" in r.json()["error"]["message"]
        assert httpx.get(sc.base("t") + "/models").status_code == 502
    (rec,) = sc.store.calls("t")
    assert rec.status == 502 and rec.error.startswith("upstream:")


def test_app_opens_and_closes_its_own_store(fake: Any, tmp_path: Any) -> None:
    from fake_vllm import ServerThread

    from harnessrl.traces.sqlite import SQLiteTraceStore
    from proxy_sidecar.app import build_app
    from proxy_sidecar.config import SidecarConfig

    db = tmp_path / "own.db"
    app = build_app(
        SidecarConfig(
            upstreams=(fake[1].url,), store=f"sqlite:///{db}", fsync=True, log_calls=False
        )
    )
    with ServerThread(app) as sc:
        assert httpx.post(sc.url + "/v1/chat/completions", json=CHAT).status_code == 200
    store = SQLiteTraceStore(db)
    assert store.count_calls("default") == 1
    store.close()


def test_capture_helpers() -> None:
    from proxy_sidecar.capture import decode_body, error_message

    assert error_message({"error": {"message": "m"}}) == "m"
    assert error_message({"message": "plain"}) == "plain"
    assert error_message(None) == "non-JSON error body"
    assert decode_body(b"<html>") is None and decode_body(b'{"a": 1}') == {"a": 1}
