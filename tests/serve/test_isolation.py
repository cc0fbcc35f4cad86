"""One bad request never fails another. The engine refuses settings it cannot run when they are
submitted, and a device step that fails takes down only the requests it ran (or, if it consumed
the donated KV cache, the ones whose rows were in it): queued requests and later ones complete.

Faults are injected by wrapping the real engine's step functions (fault injection is what the
doubles are for); everything else is the real server with the tiny random model from conftest.
"""

from __future__ import annotations

import threading

import httpx
import jax
import pytest

from harnessrl.engine.sampler import SamplingParams

MARKED = [7, 7, 7, 7]  # prompt ids the injected prefill fault recognizes


def _complete(server, body: dict, out: dict, name: str) -> None:
    out[name] = httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def _threads(*targets) -> list[threading.Thread]:
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=2**31),
        SamplingParams(temperature=float("nan")),
        SamplingParams(top_p=float("inf")),
        SamplingParams(n=0),
    ],
    ids=["top_k-int32-overflow", "nan-temperature", "inf-top_p", "no-choices"],
)
def test_the_engine_refuses_unrunnable_settings_at_submit(bounded_server, params):
    """Callers that skip the HTTP checks (in-process users) still cannot poison a shared step."""
    out: dict[str, httpx.Response] = {}
    body = {"prompt": "steady", "max_tokens": 30, "ignore_eos": True}
    (worker,) = _threads(lambda: _complete(bounded_server, body, out, "ok"))
    with pytest.raises(ValueError, match=r"sampling settings|n must be"):
        bounded_server.engine.submit([1, 2, 3], params, 4, lambda events: None)
    worker.join(timeout=120)
    assert out["ok"].status_code == 200 and out["ok"].json()["usage"]["completion_tokens"] == 30


def test_a_failed_prefill_fails_only_its_request(bounded_server, monkeypatch):
    steps = bounded_server.engine.steps
    real = steps.prefill_packed  # every first chunk of this model, packed with others or alone

    def faulty(prompts):
        if any(list(ids[:4]) == MARKED for _, ids, _ in prompts):
            raise RuntimeError("injected prefill fault")
        return real(prompts)

    monkeypatch.setattr(steps, "prefill_packed", faulty)
    compiles = bounded_server.engine.compile_count
    out: dict[str, httpx.Response] = {}
    long = {"prompt": "neighbour", "max_tokens": 300, "ignore_eos": True}
    bad = {"prompt": MARKED, "max_tokens": 5}
    workers = _threads(
        lambda: _complete(bounded_server, long, out, "long"),
        lambda: _complete(bounded_server, bad, out, "bad"),
        lambda: _complete(bounded_server, {**bad, "stream": True}, out, "bad_stream"),
    )
    for w in workers:
        w.join(timeout=120)
    assert out["long"].status_code == 200, out["long"].text[:300]
    assert out["long"].json()["usage"]["completion_tokens"] == 300
    for name in ("bad", "bad_stream"):  # failed before any token: a plain JSON error
        assert out[name].status_code == 500, out[name].text[:300]
        assert "injected prefill fault" in out[name].json()["error"]["message"]
    assert bounded_server.engine.compile_count == compiles


def test_a_step_that_eats_the_cache_fails_its_rows_and_queued_requests_still_run(
    bounded_server, monkeypatch
):
    engine, steps = bounded_server.engine, bounded_server.engine.steps
    compiles = engine.compile_count
    queued = threading.Event()
    real_submit, real_decode = engine.submit, steps.decode
    calls = {"decode": 0}

    def watched_submit(prompt_ids, params, max_tokens, sink):
        cancel = real_submit(prompt_ids, params, max_tokens, sink)
        if prompt_ids == [9, 9, 9]:
            queued.set()
        return cancel

    def faulty_decode(seqs):
        calls["decode"] += 1
        if calls["decode"] == 3:  # both slots decode the first request by now
            assert queued.wait(timeout=60)  # the second request waits behind them
            for leaf in jax.tree.leaves(steps.cache):
                leaf.delete()  # what a failed step with a donated input leaves behind
            raise RuntimeError("injected device fault")
        return real_decode(seqs)

    monkeypatch.setattr(engine, "submit", watched_submit)
    monkeypatch.setattr(steps, "decode", faulty_decode)
    out: dict[str, httpx.Response] = {}
    first = {"prompt": "running", "max_tokens": 500, "ignore_eos": True, "n": 2}
    second = {"prompt": [9, 9, 9], "max_tokens": 5, "ignore_eos": True}
    (a,) = _threads(lambda: _complete(bounded_server, first, out, "running"))
    while calls["decode"] < 2:
        threading.Event().wait(0.01)
    (b,) = _threads(lambda: _complete(bounded_server, second, out, "queued"))
    a.join(timeout=120)
    b.join(timeout=120)
    running, waiting = out["running"], out["queued"]
    assert running.status_code == 503 and running.headers["retry-after"] == "1"
    assert "lost its cache: injected device fault" in running.json()["error"]["message"]
    assert waiting.status_code == 200, waiting.text[:300]
    assert waiting.json()["usage"]["completion_tokens"] == 5
    assert not steps.cache_lost() and engine.compile_count == compiles


def test_a_stream_that_fails_midway_ends_with_an_error_chunk(bounded_server, monkeypatch):
    steps = bounded_server.engine.steps
    real = steps.decode
    calls = {"n": 0}

    def faulty(seqs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected decode fault")
        return real(seqs)

    monkeypatch.setattr(steps, "decode", faulty)
    body = {"prompt": "stream", "max_tokens": 50, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", bounded_server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert '"error"' in lines[-2] and "injected decode fault" in lines[-2]
    assert 2 <= len(lines) - 2 <= 5  # a few tokens streamed before the fault
    after = httpx.post(
        bounded_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=60
    )
    assert after.status_code == 200
