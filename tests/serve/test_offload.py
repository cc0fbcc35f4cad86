"""A long prompt does not hold other clients up: its JSON decoding, chat template, tokenizing and
response encoding run on a worker thread, with the Rust tokenizer called the way that releases
the GIL, and large bodies queue on their own thread so small requests never wait behind them.

The server is `plain_server` (conftest): a real HF `tokenizers` BPE tokenizer, whose `encode`
holds the GIL for the whole call (about 1 s per MiB of text), unlike the sleeping fakes.
"""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest

TEXT = "ab cd " * 170_000  # 1,020,000 characters: under the default 1 Mi cap, ~1 s to encode


def _small_round_trips(server, busy: threading.Event) -> list[tuple[float, float]]:
    """Alternate `GET /health` and a small `/tokenize` until `busy` clears; → (sent, answered)."""
    trips = []
    with httpx.Client(timeout=60) as client:
        while busy.is_set() and len(trips) < 200:
            t0 = time.monotonic()
            if len(trips) % 2:
                r = client.post(server.url + "/tokenize", json={"prompt": "hi"})
                assert r.json()["tokens"] == [71, 72], r.text[:200]
            else:
                assert client.get(server.url + "/health").status_code == 200
            trips.append((t0, time.monotonic()))
    return trips


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"prompt": TEXT}),
        ("/tokenize", {"messages": [{"role": "user", "content": TEXT}]}),
        ("/v1/completions", {"prompt": TEXT, "max_tokens": 1}),
    ],
    ids=["tokenize-prompt", "tokenize-chat", "completions"],
)
def test_small_requests_are_answered_while_a_long_prompt_is_tokenized(
    plain_server, timed_bpe, path, body
):
    """The probe: 1 MiB prompts stalled the server ~0.35 s each; two clients looping them cut
    everyone else's throughput by 95%. Here the encoder's own start and end bound the window."""
    timer = timed_bpe[1]
    timer.reset()
    answer: list[httpx.Response] = []
    big = threading.Thread(
        target=lambda: answer.append(httpx.post(plain_server.url + path, json=body, timeout=120))
    )
    big.start()
    assert timer.started.wait(60), "the long prompt never reached the tokenizer"
    busy = threading.Event()
    busy.set()
    watcher = threading.Thread(target=lambda: (big.join(120), busy.clear()))
    watcher.start()
    trips = _small_round_trips(plain_server, busy)
    watcher.join(timeout=120)
    assert answer, "the long request got no answer"
    assert answer[0].status_code in (200, 400), answer[0].text[:300]
    if path == "/tokenize":
        assert answer[0].json()["count"] > 1_000_000
    else:  # tokenized, then too long for the context
        assert "maximum context length" in answer[0].json()["error"]["message"]
    (start, end) = timer.windows[0]
    inside = [t for t in trips if start <= t[0] and t[1] <= end]
    # While the encoder held the GIL, no Python ran anywhere in the process: zero trips inside.
    assert len(inside) >= 3, (len(inside), len(trips), end - start)


def test_two_clients_looping_long_prompts_leave_others_their_latency(plain_server):
    """The event loop's responsiveness, measured: the median latency of small requests while two
    clients loop 1 MiB `/tokenize` stays within a generous factor of their unloaded median."""

    def latencies(n: int) -> list[float]:
        out = []
        with httpx.Client(timeout=60) as client:
            for _ in range(n):
                t0 = time.monotonic()
                r = client.post(plain_server.url + "/tokenize", json={"prompt": "hi"})
                assert r.status_code == 200
                out.append(time.monotonic() - t0)
                time.sleep(0.01)
        return out

    unloaded = statistics.median(latencies(20))
    stop = threading.Event()

    def loop() -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                r = client.post(plain_server.url + "/tokenize", json={"prompt": TEXT})
                assert r.status_code == 200

    clients = [threading.Thread(target=loop) for _ in range(2)]
    for c in clients:
        c.start()
    try:
        time.sleep(0.5)  # both are sending
        loaded = latencies(40)
    finally:
        stop.set()
        for c in clients:
            c.join(timeout=120)
    bound = max(20 * unloaded, 0.1)
    assert statistics.median(loaded) < bound, (statistics.median(loaded), unloaded)


def test_the_gil_releasing_calls_give_the_tokenizers_own_ids_and_text(timed_bpe):
    from fakes import ByteTokenizer

    from harnessrl.serve.gil import RELEASE_AT, releasing_gil

    tok = timed_bpe[0]
    fast = releasing_gil(tok)
    special = "ab <|im_end|> é\n"  # a special token, a multi-byte character
    for text in ("hi", special, special * (RELEASE_AT // len(special) + 1)):
        assert fast.encode(text) == tok.encode(text)
        ids = tok.encode(text)
        for skip in (False, True):
            assert fast.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip)
        chat = [{"role": "system", "content": text}, {"role": "user", "content": "x"}]
        for add in (False, True):
            assert fast.apply_chat_template(chat, add_generation_prompt=add) == (
                tok.apply_chat_template(chat, add_generation_prompt=add)
            )
    assert fast.decode(tok.encode(special)) == tok.decode(tok.encode(special))  # its default
    assert fast.eos_token_ids == tok.eos_token_ids
    plain = ByteTokenizer()
    assert releasing_gil(plain) is plain  # not a ChatTokenizer: used as it is
