"""Property-based fuzzing of bodies, headers and paths: the sidecar never answers 5xx itself and
never dies. (A 5xx that the upstream produced is passed through and carries its marker header.)"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx
import orjson
from hypothesis import HealthCheck, given, settings
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


def test_fuzzed_requests_never_get_a_sidecar_5xx(sidecar: Any) -> None:
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
        assert r.status_code < 500 or r.headers.get("x-fake-upstream") == "1", (
            r.status_code,
            r.text[:300],
        )
        if r.status_code >= 400 and method != "HEAD" and "x-fake-upstream" not in r.headers:
            assert "error" in r.json()
        if sidecar.state.paused:  # a fuzzed /control/pause must not stall the next example
            assert client.post("/control/resume").status_code == 200

    one()
    assert client.get("/health").status_code == 200
    assert sidecar.state.in_flight == 0
    client.close()
