"""Hostile input at the sidecar's edge: slow bodies, undecodable rollout ids, error shapes, and the
log line of every call it refuses."""

from __future__ import annotations

import asyncio
import json
import logging
import select
import socket
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy_sidecar.budget import BodyBudget
from proxy_sidecar.control import read_body
from proxy_sidecar.errors import RequestTimeout
from proxy_sidecar.metrics import Metrics

CHAT = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _answer(sock: socket.socket, limit_s: float) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of the one response `sock` gets, within `limit_s`."""
    sock.settimeout(limit_s)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or b"\0"
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def test_slow_bodies_hold_no_budget_and_end_at_the_body_deadline(
    fake: Any, make_sidecar: Any
) -> None:
    """Two clients announce bodies as large as the whole budget and trickle a byte at a time: the
    budget holds only the bytes that came, every other call is served, and the slow ones get a
    408 once their bodies have taken longer than --body-timeout-s in all (each pause is short)."""
    deadline_s = 3.0
    sc = make_sidecar(
        (fake[1].url,), max_body_bytes=20_000, max_buffered_bytes=20_000, body_timeout_s=deadline_s
    )
    head = (
        b"POST /rollouts/slow/v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        b"content-type: application/json\r\ncontent-length: 20000\r\n\r\n{"
    )
    slow = [socket.create_connection(("127.0.0.1", sc.server.port)) for _ in range(2)]
    started = time.monotonic()
    try:
        for sock in slow:
            sock.sendall(head)
        while sc.state.budget.held < 2:  # both bodies are being read
            assert time.monotonic() - started < deadline_s, sc.state.budget.held
            time.sleep(0.01)
        codes = [
            httpx.post(sc.base(f"ok{k}") + "/chat/completions", json=CHAT, timeout=10).status_code
            for k in range(10)
        ]
        assert codes == [200] * 10
        assert sc.state.budget.held == 2  # the slow bodies still in, holding one byte each
        answers = []
        for sock in slow:
            while not select.select([sock], [], [], 0.25)[0]:  # a byte every quarter second
                assert time.monotonic() - started < deadline_s + 5, "no answer to a slow body"
                sock.sendall(b" ")
            answers.append(_answer(sock, 5.0))
    finally:
        for sock in slow:
            sock.close()
    elapsed = time.monotonic() - started
    assert deadline_s <= elapsed < deadline_s + 5
    for status, headers, body in answers:
        assert status == 408 and headers["connection"] == "close"
        err = json.loads(body)["error"]
        assert err["code"] == 408 and "--body-timeout-s" in err["message"]
    assert sc.state.budget.held == 0 and sc.store.count_calls("slow") == 0
    assert sum(sc.store.count_calls(f"ok{k}") for k in range(10)) == 10


@settings(max_examples=60, deadline=None)
@given(
    pieces=st.lists(st.binary(min_size=0, max_size=50), min_size=1, max_size=8),
    extra=st.integers(0, 1000),
)
def test_a_body_takes_from_the_budget_only_what_has_arrived(
    pieces: list[bytes], extra: int
) -> None:
    """Whatever Content-Length says, the budget never holds more than the bytes received."""
    received = 0
    budget = BodyBudget(10_000, Metrics())
    declared = str(sum(map(len, pieces)) + extra).encode()

    async def receive() -> dict[str, Any]:
        nonlocal received
        assert budget.held <= received  # nothing reserved ahead of the bytes
        piece = pieces[0]
        del pieces[0]
        received += len(piece)
        return {"type": "http.request", "body": piece, "more_body": bool(pieces)}

    body = asyncio.run(
        read_body({"headers": [(b"content-length", declared)]}, receive, 5000, budget)
    )
    assert budget.held == len(body) == received == budget.peak


def test_the_body_deadline_bounds_the_whole_body_and_gives_its_bytes_back() -> None:
    budget = BodyBudget(1000, Metrics())

    async def receive() -> dict[str, Any]:  # a byte per 50 ms, forever
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b"x", "more_body": True}

    t0 = time.monotonic()
    with pytest.raises(RequestTimeout, match=r"within 0\.5 s"):
        asyncio.run(read_body({"headers": []}, receive, 1000, budget, timeout_s=0.5))
    assert 0.5 <= time.monotonic() - t0 < 2.0
    assert budget.held == 0 and budget.peak >= 5


@pytest.mark.parametrize("escape", ["%ff", "%fe", "%c3", "%80", "a%e2%82"])
def test_rollout_ids_that_are_not_utf8_are_refused(sidecar: Any, escape: str) -> None:
    """Decoded with replacement characters they would all land in one rollout."""
    for route in ("/v1/chat/completions", "/reward"):
        r = httpx.post(sidecar.url + f"/rollouts/{escape}{route}", json={**CHAT, "reward": 1.0})
        assert r.status_code == 400, (route, r.text)
        err = r.json()["error"]
        assert err["code"] == 400 and "not UTF-8" in err["message"]
    assert sidecar.store.count_calls() == 0 and sidecar.store.rollouts() == []


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ids=st.lists(st.binary(min_size=1, max_size=4), min_size=2, max_size=4, unique=True))
def test_distinct_rollout_ids_stay_distinct_or_are_refused(sidecar: Any, ids: list[bytes]) -> None:
    """Any bytes, percent-encoded: recorded under exactly their UTF-8 text, or a 400."""
    for raw in ids:
        path = "".join(f"%{b:02x}" for b in raw)
        r = httpx.post(sidecar.url + f"/rollouts/{path}/v1/chat/completions", json=CHAT)
        if b"/" in raw:  # another path: no such route
            assert r.status_code == 404
            continue
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            assert r.status_code == 400 and "not UTF-8" in r.json()["error"]["message"]
            continue
        if not text.isprintable():
            assert r.status_code == 400 and "printable" in r.json()["error"]["message"]
            continue
        assert r.status_code == 200, r.text
        assert [c.rollout_id for c in sidecar.store.calls(text)][-1:] == [text]


def test_routing_errors_answer_in_the_dialects_shape(sidecar: Any) -> None:
    """No route or a wrong method: OpenAI's shape, Anthropic's under /v1/messages; 405 says
    which methods the route takes."""
    r = httpx.get(sidecar.url + "/v1/messages")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "Method Not Allowed"},
    }
    r = httpx.post(sidecar.url + "/rollouts/a/v1/messages/count_tokens", json={})
    assert r.status_code == 404 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(sidecar.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"] == {
        "message": "Method Not Allowed",
        "type": "invalid_request_error",
        "param": None,
        "code": 405,
    }


def test_a_bug_in_the_sidecar_is_a_json_500_in_the_dialects_shape(
    sidecar: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from proxy_sidecar import proxy
    from proxy_sidecar.dialects.messages import Messages

    def broken(*args: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(proxy, "rewrite", broken)
    monkeypatch.setattr(Messages, "parse", broken)
    r = httpx.post(sidecar.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == 500 and "RuntimeError" in r.json()["error"]["message"]
    r = httpx.post(sidecar.url + "/v1/messages", json=CHAT)
    assert r.status_code == 500
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
    assert sidecar.state.budget.held == 0 and sidecar.state.in_flight == 0


def test_every_refused_call_leaves_one_log_line_with_its_reason(
    fake: Any, make_sidecar: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Refused calls reach no store: their log line is all there is, with --log-calls off too."""
    sc = make_sidecar((fake[1].url,), log_calls=False, max_body_bytes=4000, tokenizer="tiny")
    refused = [  # (path, body, route, status, words of the reason)
        ("/rollouts/r1/v1/chat/completions", b"{nope", "chat", 400, "not valid JSON"),
        ("/rollouts/r2/v1/completions", b"[1]", "completions", 400, "must be a JSON object"),
        ("/rollouts/r3/v1/messages", b'{"model": "m"}', "messages", 400, "max_tokens"),
        ("/rollouts/r4/v1/responses", b'{"input": 3}', "responses", 400, "input must be"),
        ("/rollouts/r5/v1/chat/completions", b"{" + b" " * 5000 + b"}", "chat", 413, "limit"),
        ("/rollouts/%ff/v1/completions", b"{}", "completions", 400, "not UTF-8"),
    ]
    with caplog.at_level(logging.INFO, logger="proxy_sidecar.calls"):
        for path, body, *_ in refused:
            assert httpx.post(sc.url + path, content=body).status_code >= 400
        assert httpx.post(sc.base("fine") + "/chat/completions", json=CHAT).status_code == 200
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "proxy_sidecar.calls"]
    assert len(lines) == len(refused)  # the served call: no line, as --log-calls is off
    for line, (_, _, route, status, words) in zip(lines, refused, strict=True):
        assert line["event"] == "refused" and line["route"] == route
        assert line["status"] == status and words in line["error"]
    assert [line["rollout"] for line in lines[:5]] == ["r1", "r2", "r3", "r4", "r5"]
    assert lines[5]["rollout"] == "\ufffd"  # as the server decoded it; refused for that
