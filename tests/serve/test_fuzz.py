"""Property-based fuzzing of the real embedded server (tiny random model, kept warm for the
module): malformed and extreme requests (wrong types, huge and negative numbers, NaN, deep
nesting, unknown fields, bad JSON, giant strings, extreme n / top_k / max_tokens / logprobs /
temperature / stop lists) never get a 5xx, never hang, and leave the server answering a normal
request afterwards with no new compiles."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fakes import VOCAB, ByteTokenizer
from flax import nnx
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.families.dense.decoder import Decoder
from harnessrl.serve.app import start_server
from harnessrl.serve.config import ServeConfig

DEEP = "__deep__"  # stands for a value nested deeper than json.dumps can write; spliced in


@pytest.fixture(scope="module")
def server():
    cfg = ModelConfig.tiny(vocab_size=VOCAB, eos_token_id=257, max_position_embeddings=128)
    config = ServeConfig(
        model="tiny",
        port=0,
        num_slots=4,
        max_model_len=128,
        prefill_buckets=(32, 128),
        max_n=8,
        max_body_bytes=1 << 20,
        max_prompt_chars=200_000,
    )
    handle = start_server(Decoder(cfg, rngs=nnx.Rngs(0)), ByteTokenizer(), config)
    yield handle
    handle.stop()


edge_ints = st.sampled_from(
    [
        *(-(2**63), -(2**31) - 1, -2, -1, 0, 1, 2, 3, 8, 9, 20, 21, 128),
        *(2**31 - 1, 2**31, 2**53, 2**63 - 1, 2**64 - 1, 10**9),
    ]
)
# NaN and infinities are not JSON (json.dumps writes them anyway: a 400); kept rare so most
# bodies parse and reach the checks behind the parser.
edge_floats = st.sampled_from([1e308, -1e308, 5e-324, -0.0, 1e-9, 0.5, 1.0, 2.0, 100.0, 101.0])
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=30)
giant = st.integers(1_000, 300_000).map(lambda k: "é" * k)
scalars = (
    st.none()
    | st.booleans()
    | edge_ints
    | st.integers(-(10**6), 10**6)
    | edge_floats
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts
)
values = st.recursive(
    scalars | giant | st.just(DEEP),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=10,
)
messages = st.one_of(
    values,
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | values},
            optional={"content": texts | values, "name": values},
        ),
        max_size=4,
    ),
)
FIELDS = {
    "n": edge_ints | values,
    "top_k": edge_ints | values,
    "max_tokens": edge_ints | values,
    "max_completion_tokens": edge_ints,
    "logprobs": st.booleans() | edge_ints,
    "top_logprobs": edge_ints,
    "temperature": edge_floats | edge_ints | values,
    "top_p": edge_floats | values,
    "min_p": edge_floats,
    "seed": edge_ints | values,
    "stop": st.lists(st.text(st.characters(exclude_categories=("Cs",)), max_size=300), max_size=40)
    | values,
    "stop_token_ids": st.lists(edge_ints, max_size=300) | values,
    "stream": st.booleans() | values,
    "stream_options": values,
    "echo": st.booleans() | values,
    "tools": values,
    "tool_choice": values,
    "messages": messages,
    "prompt": texts | st.lists(edge_ints, max_size=40) | values,
    "model": st.just("tiny") | values,
    "ignore_eos": st.booleans() | values,
    "best_of": edge_ints,
    "presence_penalty": edge_floats,
    "return_token_ids": st.booleans() | values,
    "add_generation_prompt": values,
    "tokens": st.lists(edge_ints, max_size=20) | values,
    "unknown_field": values,
}
overrides = st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), max_size=4).flatmap(
    lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in keys})
)
BASE = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "prompt": "hi",
    "max_tokens": 4,
}


def _encode(body: Any, depth: int) -> bytes:
    text = json.dumps(body)  # writes NaN/Infinity literals, which are not JSON: a 400
    nested = "[" * depth + "1" + "]" * depth
    return text.replace(json.dumps(DEEP), nested).encode()


bodies = st.one_of(
    st.binary(max_size=300),
    st.sampled_from(
        [
            b"",
            b"{",
            b'{"prompt": "x"',
            b"[" * 5000 + b"]" * 5000,
            b'{"a":' * 2000 + b"1" + b"}" * 2000,
            b'{"prompt": "\\ud800", "max_tokens": 2}',
            b'{"messages": [{"role": "user", "content": "\\u0000"}], "max_tokens": 2}',
            b'{"prompt": "x", "temperature": NaN}',
            b'{"prompt": "x", "n": Infinity, "top_k": -Infinity}',
        ]
    ),
    st.tuples(overrides, st.sampled_from([1, 30, 250, 1000, 1100])).map(
        lambda pair: _encode({**BASE, **pair[0]}, pair[1])
    ),
)
PATHS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]


def test_fuzzed_requests_never_get_a_5xx_nor_hang(server):
    client = httpx.Client(base_url=server.url, timeout=60)  # a hang fails as a timeout
    compiles = server.engine.compile_count

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(PATHS), body=bodies)
    def one(path: str, body: bytes) -> None:
        with client.stream("POST", path, content=body) as r:
            raw = r.read()  # a stream must end too
        event(f"{path} -> {r.status_code}")  # see --hypothesis-show-statistics
        assert r.status_code < 500, (r.status_code, raw[:300])
        if r.status_code >= 400:
            error = json.loads(raw)["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == r.status_code
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert raw.endswith(b"data: [DONE]\n\n"), raw[-300:]

    one()
    normal = client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
    )
    assert normal.status_code == 200 and normal.json()["usage"]["completion_tokens"] >= 1
    assert client.get("/health").status_code == 200
    assert server.engine.compile_count == compiles
    client.close()
