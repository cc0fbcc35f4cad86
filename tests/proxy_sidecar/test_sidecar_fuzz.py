"""Property-based fuzzing of bodies, headers and paths, through the sidecar to the fake vLLM and to
the real embedded server: no 5xx from the sidecar (nor from the real server), no hang, no death.
(A 5xx that the fake produced is passed through and carries its marker header.)"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import quote

import httpx
import orjson
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

KNOWN = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/rollouts/fz/v1/chat/completions",
    "/rollouts/fz/v1/completions",
    "/rollouts/fz/reward",
    "/rollouts/fz/finish",
    "/control/status",
    "/control/pause",
    "/control/resume",
    "/control/policy_version",
    "/control/mode",
    "/health",
    "/metrics",
]
# Percent-encoded, so any character (controls, '/', unicode) reaches the server's router.
segment = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12
).map(lambda s: quote(s, safe=""))
paths = st.one_of(
    st.sampled_from(KNOWN),
    st.lists(segment, min_size=1, max_size=5).map(lambda parts: "/" + "/".join(parts)),
    st.builds(lambda rid: f"/rollouts/{rid}/v1/chat/completions", segment),
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "model",
    "messages",
    "prompt",
    "stream",
    "n",
    "max_tokens",
    "logprobs",
    "tools",
    "stream_options",
    "seed",
    "top_k",
    "top_p",
    "temperature",
    "top_logprobs",
    "stop",
    "max_completion_tokens",
    "version",
    "reward",
    "state",
    "mode",
    "drain_timeout_s",
]
request_like = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).map(
    lambda d: {
        "model": "smol",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2,
        **d,
    }
)
bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(orjson.dumps),
    request_like.map(orjson.dumps),
)
header_names = st.sampled_from(
    [
        "content-type",
        "authorization",
        "accept",
        "x-harnessrl-policy-version",
        "accept-encoding",
        "user-agent",
        "x-custom",
    ]
)
# Any byte a server accepts in a header value: printable ASCII and latin-1.
header_values = (
    st.text(
        st.characters(min_codepoint=32, max_codepoint=255, exclude_characters="\x7f"), max_size=40
    )
    .map(str.strip)
    .map(lambda v: v.encode("latin-1"))
)
queries = st.one_of(st.just(""), st.binary(max_size=20).map(lambda b: "?" + quote(b, safe="=&")))
headers = st.dictionaries(header_names, header_values, max_size=4)


def settled(sidecar: Any, timeout_s: float = 10.0) -> None:
    """No call left in flight. (A handler leaves just after its response's last bytes went out,
    so a client can read the response first.)"""
    deadline = time.monotonic() + timeout_s
    while sidecar.state.in_flight:
        assert time.monotonic() < deadline, f"{sidecar.state.in_flight} calls still in flight"
        time.sleep(0.01)


def test_fuzzed_requests_never_get_a_5xx(upstream_url: str, make_sidecar: Any) -> None:
    """Against the fake, a 5xx the fake itself produced passes through (marked); against the real
    embedded server nothing may answer 5xx, nothing may hang (30 s per request), and both still
    serve a normal call afterwards."""
    sidecar = make_sidecar((upstream_url,))
    fake = "x-fake-upstream"
    client = httpx.Client(base_url=sidecar.url, timeout=30)

    @settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD"]),
        path=paths,
        query=queries,
        body=bodies,
        hdrs=headers,
    )
    def one(method: str, path: str, query: str, body: bytes, hdrs: dict[str, bytes]) -> None:
        r = client.request(method, path + query, content=body, headers=hdrs)
        assert r.status_code < 500 or r.headers.get(fake) == "1", (r.status_code, r.text[:300])
        if r.status_code >= 400 and method != "HEAD" and fake not in r.headers:
            assert "error" in r.json()  # the sidecar's own errors and the server's: one shape
        if sidecar.state.paused:  # a fuzzed /control/pause must not stall the next example
            assert client.post("/control/resume").status_code == 200

    one()
    assert client.get("/health").status_code == 200
    settled(sidecar)
    client.post("/control/mode", json={"mode": "train"})
    normal = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/rollouts/after-fuzz/v1/chat/completions", json=normal).status_code == 200
    (rec,) = sidecar.store.calls("after-fuzz")
    assert rec.ok, rec.error
    client.close()


extreme_ints = st.sampled_from([0, -1, 1, 2, 64, 65, 2**31 - 1, 2**31, 2**63, -(2**63), 10**9])
generation = st.fixed_dictionaries(
    {
        "model": st.just("smol"),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text()}
            ),
            min_size=1,
            max_size=3,
        ),
        "max_tokens": st.one_of(st.integers(1, 6), extreme_ints, st.none()),
    },
    optional={
        "n": st.one_of(st.integers(1, 3), extreme_ints, json_values),
        "top_k": st.one_of(extreme_ints, json_values),
        "top_p": st.one_of(st.floats(allow_nan=False), json_values),
        "temperature": st.one_of(st.floats(0, 3), st.floats(allow_nan=False), json_values),
        "seed": st.one_of(extreme_ints, st.integers(-(2**63), 2**64 - 1), json_values),
        "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=5)),
        "stream": st.one_of(st.booleans(), json_values),
        "stream_options": st.one_of(st.just({"include_usage": True}), json_values),
        "logprobs": st.one_of(st.booleans(), extreme_ints, json_values),
        "top_logprobs": st.one_of(extreme_ints, json_values),
    },
)


def test_fuzzed_generation_requests_are_served_or_refused_and_always_recorded(
    upstream_url: str, make_sidecar: Any
) -> None:
    """Well-formed JSON objects with extreme and ill-typed sampling fields, posted for generation:
    each one reaches the upstream, gets an answer (never a 5xx from the real server, never a
    hang) and is recorded once; a 200's stored token ids are the ones the client got."""
    # An upstream that hangs shows as the sidecar's 504 (and the server hears the hang-up).
    sidecar = make_sidecar((upstream_url,), read_timeout_s=8)
    client = httpx.Client(base_url=sidecar.url, timeout=30)
    sent = 0

    # No shrinking: a hang costs the whole timeout per replay, and these requests are small.
    @settings(
        max_examples=60,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
    )
    @given(request=generation, chat=st.booleans())
    # A completion prompt whose text tokenizes to no ids at all (SmolLM2's tokenizer drops \x16).
    @example(
        request={"model": "smol", "messages": [{"role": "user", "content": "\x16"}]}, chat=False
    )
    def one(request: dict[str, Any], chat: bool) -> None:
        nonlocal sent
        if not chat:  # the same fields with a prompt instead (a new dict: hypothesis owns this one)
            prompt = request["messages"][0]["content"]
            request = {**{k: v for k, v in request.items() if k != "messages"}, "prompt": prompt}
        path = "/rollouts/gen/v1/" + ("chat/completions" if chat else "completions")
        r = client.post(path, content=orjson.dumps(request))
        sent += 1
        assert r.status_code < 500 or r.headers.get("x-fake-upstream") == "1", r.text[:300]
        calls = sidecar.store.calls("gen")
        assert len(calls) == sent  # every call recorded, once, whatever its answer
        if r.status_code == 200 and "text/event-stream" not in r.headers["content-type"]:
            got = [c["token_ids"] for c in r.json()["choices"]]
            assert [list(c.token_ids) for c in calls[-1].choices] == got

    one()
    normal = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/rollouts/gen/v1/chat/completions", json=normal).status_code == 200
    settled(sidecar)
    client.close()
