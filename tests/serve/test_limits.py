"""Request limits of the embedded server over real HTTP (tiny random model, see conftest): each is
refused in vLLM's error body before anything is allocated or tokenized, and the server keeps
answering everyone else meanwhile.

Timing bounds are an order of magnitude apart from what the bug they guard against costs (the
unbounded server spent 20 s on n=10^9; the byte tokenizer here sleeps 1 µs per character), so a
loaded 2-core machine does not flip them.
"""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import orjson
import pytest
from probes import HealthPoll, body_of, connect, read_until_closed, status_of

CHAT = [{"role": "user", "content": "Count to three."}]


def _post(server, path: str, body: dict, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout)


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    return error


def test_huge_n_is_refused_at_once_while_health_answers(bounded_server):
    with HealthPoll(bounded_server.url) as poll:
        t0 = time.monotonic()
        r = _post(bounded_server, "/v1/chat/completions", {"messages": CHAT, "n": 1_000_000_000})
        elapsed = time.monotonic() - t0
    error = _error(r, 400, "n")
    assert "n must be <= 4" in error["message"] and error["type"] == "BadRequestError"
    assert elapsed < 2.0, elapsed  # the unbounded engine built 10^9 sequences first (20 s)
    assert set(poll.statuses) == {200} and poll.worst < 2.0, (poll.statuses, poll.worst)
    _error(_post(bounded_server, "/v1/completions", {"prompt": "x", "n": 5}), 400, "n")


def test_n_times_max_tokens_is_bounded_per_request(bounded_server):
    over = _post(bounded_server, "/v1/completions", {"prompt": "x", "n": 4, "max_tokens": 1000})
    assert "ask for 4000 tokens" in _error(over, 400, "max_tokens")["message"]
    # Unset max_tokens fills the context: 4 choices x ~1000 tokens each is over 3000 too.
    fill = _post(bounded_server, "/v1/chat/completions", {"messages": CHAT, "n": 4})
    assert "lower n or max_tokens" in _error(fill, 400, "n")["message"]
    ok = _post(bounded_server, "/v1/completions", {"prompt": "x", "n": 3, "max_tokens": 4})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 3


def test_top_k_beyond_int32_fails_alone_while_others_complete(bounded_server):
    results: dict[str, httpx.Response] = {}

    def normal(i: int) -> None:
        body = {"prompt": f"job {i}", "max_tokens": 40, "ignore_eos": True, "seed": i}
        results[f"ok{i}"] = _post(bounded_server, "/v1/completions", body)

    threads = [threading.Thread(target=normal, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    bad = _post(bounded_server, "/v1/completions", {"prompt": "x", "top_k": 2147483648})
    for t in threads:
        t.join(timeout=120)
    assert "top_k must be <= 2147483647" in _error(bad, 400)["message"]
    for i in range(3):
        r = results[f"ok{i}"]
        assert r.status_code == 200, r.text[:300]
        assert r.json()["usage"]["completion_tokens"] == 40


def test_top_k_off_values_and_the_int32_maximum_sample_the_full_vocabulary(bounded_server):
    body = {"prompt": "abc", "max_tokens": 12, "seed": 7, "ignore_eos": True}
    body["return_token_ids"] = True
    outs = []
    for top_k in (-1, 0, 2147483647):
        r = _post(bounded_server, "/v1/completions", {**body, "top_k": top_k})
        assert r.status_code == 200, r.text[:300]
        outs.append(r.json()["choices"][0]["token_ids"])
    # top_k above the vocabulary keeps every token: the same draw as no top-k at all.
    assert outs[0] == outs[1] == outs[2]
    _error(_post(bounded_server, "/v1/completions", {**body, "top_k": -2}), 400)


def test_prompt_ids_longer_than_the_context_get_vllms_error(bounded_server):
    r = _post(bounded_server, "/v1/completions", {"prompt": [65] * 100_000, "max_tokens": 1})
    error = _error(r, 400, "input_tokens")
    assert "maximum context length is 1024 tokens" in error["message"]
    assert "at least 100000 input tokens" in error["message"]


def test_prompt_characters_are_capped_before_tokenizing(bounded_server, bounded_tokenizer):
    text = "a" * 3_000_001  # one over the cap; tokenizing it would cost 3 s
    r = _post(bounded_server, "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert "more than 3000000 characters" in _error(r, 400, "prompt")["message"]
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    _error(_post(bounded_server, "/v1/chat/completions", chat), 400, "messages")
    _error(_post(bounded_server, "/tokenize", {"prompt": text}), 400, "prompt")
    assert bounded_tokenizer.longest < 3_000_001


def test_a_long_prompt_is_tokenized_off_the_event_loop(bounded_server):
    text = "b" * 2_000_000  # about 2 s to tokenize; then it does not fit the context
    done: dict[str, tuple[float, httpx.Response]] = {}

    def send(name: str, prompt: str) -> None:
        r = _post(bounded_server, "/v1/completions", {"prompt": prompt, "max_tokens": 3})
        done[name] = (time.monotonic(), r)

    with HealthPoll(bounded_server.url) as poll:
        t0 = time.monotonic()
        big = threading.Thread(target=send, args=("big", text))
        big.start()
        time.sleep(0.3)  # the big prompt is being tokenized now
        send("small", "hi")
        big.join(timeout=60)
    (small_at, small), (big_at, large) = done["small"], done["big"]
    assert small.status_code == 200, small.text[:300]
    assert "maximum context length" in _error(large, 400, "input_tokens")["message"]
    assert big_at - t0 >= 2.0  # it really was tokenized (the tokenizer sleeps 1 µs per character)
    assert small_at < big_at  # the small request did not wait behind the big one
    assert set(poll.statuses) == {200} and poll.worst < 1.0, poll.worst


def test_a_body_over_the_limit_is_413_whether_or_not_its_length_is_declared(bounded_server):
    payload = b'{"prompt": "' + b"c" * (8 << 20) + b'"}'
    declared = httpx.post(bounded_server.url + "/v1/completions", content=payload, timeout=60)
    error = _error(declared, 413)
    assert "8388608-byte limit" in error["message"] and error["type"] == "Request Entity Too Large"
    assert declared.headers["connection"] == "close"

    def chunks():  # no content-length: the server must stop reading at the limit
        for i in range(0, len(payload), 1 << 16):
            yield payload[i : i + (1 << 16)]

    streamed = httpx.post(bounded_server.url + "/tokenize", content=chunks(), timeout=60)
    _error(streamed, 413)


MiB = 1 << 20


def _open_body(server, declared: int, first: bytes):
    """A raw `POST /tokenize` that declares `declared` body bytes and sends `first` of them."""
    sock = connect(server.url, timeout_s=30)
    head = (
        f"POST /tokenize HTTP/1.1\r\nhost: test\r\nconnection: close\r\n"
        f"content-type: application/json\r\ncontent-length: {declared}\r\n\r\n"
    )
    sock.sendall(head.encode() + first)
    return sock


def _prompt_body(size: int) -> bytes:
    """A `/tokenize` body of exactly `size` bytes (its prompt is over the 3M-character cap: 400)."""
    return b'{"prompt": "' + b"c" * (size - 14) + b'"}'


def _send(sock, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the server answered and closed early: read next
        sock.sendall(data)


def test_bodies_in_flight_share_one_budget_and_the_one_past_it_is_503(bounded_server):
    """The probe: 60 concurrent 15 MB bodies took the server from 0.74 to 2.1 GiB. The budget
    (16 MiB here) counts bytes as they arrive, not as declared: a slow client holds only what it
    sent, so two that declare 8 MiB and send 10 bytes leave room for two 7 MiB bodies."""
    slow = [_open_body(bounded_server, 8 * MiB, b'{"prompt": ') for _ in range(2)]
    full = _prompt_body(8 * MiB - 1024)  # two of them and the slow ones' bytes fit the budget
    a, b = (_open_body(bounded_server, len(full), full[: 7 * MiB]) for _ in range(2))
    time.sleep(0.3)  # the server has read both 7 MiB (its pause limit is 1 s)
    c = _open_body(bounded_server, 3 * MiB, b"")
    _send(c, b"d" * (3 * MiB))
    refused = read_until_closed(c, timeout_s=3)
    for sock in (a, b):
        sock.sendall(full[7 * MiB :])
    answers = [read_until_closed(sock, timeout_s=30) for sock in (a, b)]
    for sock in (*slow, a, b, c):
        sock.close()
    assert status_of(refused) == 503, refused[:300]
    error = orjson.loads(body_of(refused))["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
    assert "16777216-byte budget" in error["message"] and "max_buffered_bytes" in error["message"]
    assert b"retry-after: 1" in refused.lower() and b"connection: close" in refused.lower()
    # The two it had admitted were read to the end (16 MiB: the budget exactly) and answered.
    assert [status_of(r) for r in answers] == [400, 400], [r[:300] for r in answers]
    # Everything was given back: two full bodies at once fit again.
    again = [_open_body(bounded_server, len(full), full) for _ in range(2)]
    assert [status_of(read_until_closed(s, timeout_s=30)) for s in again] == [400, 400]


def test_a_body_still_arriving_at_its_deadline_is_408(bounded_server):
    """A client that never pauses long (0.3 s; the pause limit is 1 s) but never finishes held
    its share of the budget forever; the whole body now has 4 s (`body_timeout_s`)."""
    sock = _open_body(bounded_server, MiB, b'{"prompt": "')
    t0, response = time.monotonic(), b""
    sock.settimeout(0.3)
    while time.monotonic() - t0 < 10 and not response:
        _send(sock, b"e" * 1024)
        try:
            response = sock.recv(65536)
        except TimeoutError:
            continue
    elapsed = time.monotonic() - t0
    response += read_until_closed(sock, timeout_s=10) if response else b""
    sock.close()
    assert response, "still reading the body after 10 s"
    assert status_of(response) == 408, response[:300]
    assert 3.5 < elapsed < 8, elapsed
    error = orjson.loads(body_of(response))["error"]
    assert "4.0 s" in error["message"] and "body_timeout_s" in error["message"]
    assert httpx.get(bounded_server.url + "/health", timeout=10).status_code == 200


def test_a_full_queue_is_503_with_retry_after(bounded_server):
    """2 slots + 2 waiting: a request with 4 choices decodes 2 and queues 2 until those finish;
    meanwhile a request with 3 more choices does not fit and gets 503 with Retry-After."""
    long = {"prompt": "busy", "max_tokens": 740, "ignore_eos": True, "stream": True, "n": 4}
    url = bounded_server.url + "/v1/completions"
    with httpx.Client(timeout=60) as client, client.stream("POST", url, json=long) as first:
        lines = first.iter_lines()  # kept: dropping the iterator would close the stream
        assert next(lines).startswith("data: ")  # choices 0, 1 decode; 2, 3 wait 740 steps
        full = httpx.post(url, json={"prompt": "x", "max_tokens": 1, "n": 3}, timeout=60)
    assert "sequences are waiting" in _error(full, 503)["message"]
    assert full.headers["retry-after"] == "1"
    # The stream was dropped early: all four of its choices left the engine.
    r = _post(bounded_server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 4})
    assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
        ("/tokenize", {"messages": "hi"}, "messages"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/v1/completions", {"prompt": "x", "stop": ["s"] * 33}, None),
        ("/v1/completions", {"prompt": "x", "stop": ["s" * 257]}, None),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": list(range(257))}, None),
    ],
)
def test_side_route_and_list_limits_are_400s(bounded_server, path, body, param):
    _error(_post(bounded_server, path, body), 400, param)
