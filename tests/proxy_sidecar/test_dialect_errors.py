"""Token-in dialects on bad input and upstream trouble: every error answers in the dialect's own
shape (OpenAI's `{"error": {...}}`, Anthropic's `{"type": "error", ...}`), 4xx for bad input and
never a 500; failed calls are recorded with their error. Against the fake vLLM."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from fake_vllm import FakeVLLM, ServerThread, free_port
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harnessrl.model.tokenizer import ChatTokenizer
from harnessrl.traces.schema import CallRecord
from harnessrl.traces.sqlite import SQLiteTraceStore
from proxy_sidecar.dialects.models import anthropic_list
from proxy_sidecar.dialects.tokens import load_tokenizer
from proxy_sidecar.errors import NoUpstream

ROUTES = {"responses": "/v1/responses", "messages": "/v1/messages"}
GOOD = {
    "responses": {"model": "smol", "input": "hi", "max_output_tokens": 3},
    "messages": {"model": "smol", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
}


def assert_shape(dialect: str, resp: httpx.Response, status: int | None = None) -> str:
    """The error message, after checking the body has the dialect's error shape."""
    if status is not None:
        assert resp.status_code == status, resp.text
    assert 400 <= resp.status_code < 600 and resp.status_code != 500, resp.text
    body = resp.json()
    if dialect == "responses":
        assert set(body) == {"error"} and isinstance(body["error"]["message"], str)
        assert body["error"]["code"] == resp.status_code
        return str(body["error"]["message"])
    assert body["type"] == "error" and isinstance(body["error"]["type"], str)
    return str(body["error"]["message"])


@pytest.fixture
def tokenin(fake: tuple[FakeVLLM, ServerThread], make_sidecar: Callable[..., Any]) -> Any:
    return make_sidecar((fake[1].url,), tokenizer="tiny")


@pytest.mark.parametrize("dialect", ["responses", "messages"])
def test_routes_are_off_without_a_tokenizer(dialect: str, sidecar: Any) -> None:
    resp = httpx.post(sidecar.url + ROUTES[dialect], json=GOOD[dialect])
    assert "--tokenizer" in assert_shape(dialect, resp, 404)
    assert sidecar.store.count_calls() == 0


BAD: dict[str, list[tuple[Any, str]]] = {
    "responses": [
        (b"{not json", "not valid JSON"),
        ([1, 2], "must be a JSON object"),
        ({"model": "smol"}, "input is required"),
        ({"input": []}, "at least one item"),
        ({"input": 3}, "input must be a string or a list"),
        ({"input": [{"role": "tool", "content": "x"}]}, "role must be"),
        ({"input": [{"type": "image", "url": "x"}]}, "'image' item"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "'input_image' part"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "call_id"),
        ({"input": [{"type": "function_call_output", "output": "5"}]}, "call_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "only function tools"),
        ({"input": "x", "tools": {"type": "function"}}, "tools must be a list"),
        ({"input": "x", "tools": [{"type": "function", "name": ""}]}, "name must be"),
        ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": "x", "stream": "yes"}, "stream must be a boolean"),
        ({"input": "x", "instructions": 7}, "instructions must be a string"),
        ({"input": "x", "model": 7}, "model must be a string"),
        ({"input": "x", "background": True}, "not supported"),
        ({"input": "x", "previous_response_id": "resp_none"}, "not found"),
    ],
    "messages": [
        (b"[", "not valid JSON"),
        ({"max_tokens": 3, "messages": []}, "model"),
        ({"model": "smol", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"model": "smol", "max_tokens": 3, "messages": []}, "non-empty list"),
        ({"model": "smol", "max_tokens": 3, "messages": [{"role": "system"}]}, "role user or"),
        (
            {"model": "smol", "max_tokens": 3, "messages": [{"role": "user", "content": 5}]},
            "string or a list",
        ),
        (
            {"model": "smol", "max_tokens": 3, "messages": [{"role": "user", "content": [5]}]},
            "content block",
        ),
        (
            {
                "model": "smol",
                "max_tokens": 3,
                "messages": [{"role": "user", "content": [{"type": "image"}]}],
            },
            "'image' block",
        ),
        (
            {
                "model": "smol",
                "max_tokens": 3,
                "messages": [{"role": "user", "content": [{"type": "tool_result"}]}],
            },
            "tool_use_id",
        ),
        (
            {
                "model": "smol",
                "max_tokens": 3,
                "messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}],
            },
            "id and name",
        ),
        (
            {
                "model": "smol",
                "max_tokens": 3,
                "messages": [{"role": "assistant", "content": [{"type": "document"}]}],
            },
            "not supported",
        ),
        (
            {
                "model": "smol",
                "max_tokens": 3,
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 3}],
                    }
                ],
            },
            "JSON object",
        ),
        (
            {**GOOD["messages"], "tools": [{"type": "bash_20250124", "name": "bash"}]},
            "client tools",
        ),
        ({**GOOD["messages"], "tools": "add"}, "tools must be a list"),
        ({**GOOD["messages"], "tool_choice": "auto"}, "tool_choice"),
        ({**GOOD["messages"], "stop_sequences": [""]}, "stop_sequences"),
        ({**GOOD["messages"], "stream": 1}, "stream must be a boolean"),
        ({**GOOD["messages"], "top_k": 0}, "top_k"),
        ({**GOOD["messages"], "system": [{"type": "text", "text": 3}]}, "text must be a string"),
    ],
}


@pytest.mark.parametrize(
    ("dialect", "body", "says"),
    [(d, body, says) for d, cases in BAD.items() for body, says in cases],
)
def test_bad_bodies_are_4xx_in_the_dialect_shape(
    dialect: str, body: Any, says: str, tokenin: Any
) -> None:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    resp = httpx.post(tokenin.url + ROUTES[dialect], content=content)
    assert says in assert_shape(dialect, resp, 400)
    assert tokenin.store.count_calls() == 0  # refused before any upstream call


@pytest.mark.parametrize("dialect", ["responses", "messages"])
def test_upstream_errors_keep_their_status_and_are_recorded(
    dialect: str, fake: tuple[FakeVLLM, ServerThread], tokenin: Any
) -> None:
    url = tokenin.base("up") + ROUTES[dialect].removeprefix("/v1")
    resp = httpx.post(url, json={**GOOD[dialect], "model": "other"})
    assert "does not exist" in assert_shape(dialect, resp, 404)
    fake[0].honor_token_ids = False  # a server that cannot do token-in
    resp = httpx.post(url, json=GOOD[dialect])
    assert "token_ids" in assert_shape(dialect, resp, 502)
    calls = tokenin.store.calls("up")
    assert [c.status for c in calls] == [404, 502] and all(c.error for c in calls)
    assert calls[0].request["model"] == "other"


@pytest.mark.parametrize("dialect", ["responses", "messages"])
def test_no_upstream_is_a_502_in_shape(dialect: str, make_sidecar: Callable[..., Any]) -> None:
    dead = make_sidecar((f"http://127.0.0.1:{free_port()}",), tokenizer="tiny", retries=0)
    resp = httpx.post(dead.url + ROUTES[dialect], json=GOOD[dialect])
    assert "no upstream answered" in assert_shape(dialect, resp, 502)
    (call,) = dead.store.calls("default")
    assert call.error and call.request == GOOD[dialect]


def test_mid_stream_failures_end_in_an_error_event(
    fake: tuple[FakeVLLM, ServerThread], tokenin: Any
) -> None:
    fake[0].drop_after_chunks = 2
    client = openai.OpenAI(base_url=tokenin.base("drop"), api_key="k", max_retries=0)
    events = list(
        client.responses.create(model="smol", input="hi", max_output_tokens=8, stream=True)
    )
    assert events[0].type == "response.created" and events[-1].type == "error"
    ant = anthropic.Anthropic(base_url=f"{tokenin.url}/rollouts/drop", api_key="k", max_retries=0)
    with (
        pytest.raises(anthropic.APIStatusError),
        ant.messages.stream(
            model="smol", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        ) as stream,
    ):
        for _ in stream:
            pass
    calls = tokenin.store.calls("drop")
    assert len(calls) == 2 and all(c.error and "mid-stream" in c.error for c in calls)


def test_streams_without_token_ids_end_in_an_error_event(
    fake: tuple[FakeVLLM, ServerThread], tokenin: Any
) -> None:
    fake[0].honor_token_ids = False
    client = openai.OpenAI(base_url=tokenin.base("noids"), api_key="k", max_retries=0)
    events = list(
        client.responses.create(model="smol", input="hi", max_output_tokens=4, stream=True)
    )
    assert events[-1].type == "error" and "token_ids" in events[-1].message
    (call,) = tokenin.store.calls("noids")
    assert call.error and "token_ids" in call.error


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)
FIELDS = {
    "responses": ["model", "input", "instructions", "tools", "tool_choice", "stream", "store",
                  "max_output_tokens", "temperature", "top_p", "previous_response_id", "metadata"],
    "messages": ["model", "max_tokens", "messages", "system", "tools", "tool_choice", "stream",
                 "stop_sequences", "temperature", "top_p", "top_k"],
}  # fmt: skip
items = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            ["message", "function_call", "function_call_output", "reasoning", "x"]
        )
    },
    optional={
        "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | json_values,
        "content": json_values
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["input_text", "output_text", "x"]), "text": json_values}
            )
        ),
        "call_id": json_values,
        "name": json_values,
        "arguments": json_values,
        "output": json_values,
    },
)
blocks = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image"])},
    optional={"text": json_values, "id": json_values, "name": json_values, "input": json_values,
              "tool_use_id": json_values, "content": json_values},
)  # fmt: skip
turns = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]) | json_values,
     "content": st.text(max_size=8) | st.lists(blocks, max_size=3) | json_values},
)  # fmt: skip


def bodies(dialect: str) -> st.SearchStrategy[dict[str, Any]]:
    base = st.dictionaries(st.sampled_from(FIELDS[dialect]), json_values, max_size=5)
    if dialect == "responses":
        inner = st.fixed_dictionaries({"input": st.lists(items, max_size=3)})
    else:
        inner = st.fixed_dictionaries({"messages": st.lists(turns, max_size=3)})
    return st.tuples(st.just(GOOD[dialect]), inner, base).map(lambda t: {**t[0], **t[1], **t[2]})


@pytest.mark.parametrize("dialect", ["responses", "messages"])
def test_fuzzed_bodies_never_500(dialect: str, tokenin: Any) -> None:
    client = httpx.Client(base_url=tokenin.url, timeout=30)

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=bodies(dialect))
    def check(body: dict[str, Any]) -> None:
        body = {**body, "stream": body.get("stream") is True}  # streams are fuzzed below
        resp = client.post(ROUTES[dialect], content=orjson.dumps(body))
        if resp.status_code != 200:
            assert_shape(dialect, resp)

    check()
    client.close()


def test_an_api_key_reaches_the_upstream_as_a_bearer_token(
    fake: tuple[FakeVLLM, ServerThread], tokenin: Any
) -> None:
    resp = httpx.post(
        tokenin.url + "/v1/messages",
        json=GOOD["messages"],
        headers={"x-api-key": "sk-ant-1", "anthropic-version": "2023-06-01"},
    )
    assert resp.status_code == 200, resp.text
    (seen,) = fake[0].seen
    assert (b"authorization", b"Bearer sk-ant-1") in seen["headers"]


class BrokenStore(SQLiteTraceStore):
    """A store whose commits all fail (a full disk, a lost database)."""

    inline_writes = False

    def add_calls(self, calls: list[CallRecord]) -> list[int]:
        raise OSError("disk full")

    def add_call(self, call: CallRecord) -> int:
        raise OSError("disk full")


@pytest.mark.parametrize("dialect", ["responses", "messages"])
def test_a_call_the_store_cannot_record_is_a_503(
    dialect: str,
    fake: tuple[FakeVLLM, ServerThread],
    make_sidecar: Callable[..., Any],
    tmp_path: Path,
) -> None:
    broken = make_sidecar((fake[1].url,), store=BrokenStore(tmp_path / "b.db"), tokenizer="tiny")
    resp = httpx.post(broken.url + ROUTES[dialect], json=GOOD[dialect])
    assert "could not record" in assert_shape(dialect, resp, 503)
    with httpx.stream(
        "POST", broken.url + ROUTES[dialect], json={**GOOD[dialect], "stream": True}
    ) as r:
        body = r.read().decode()
    assert r.status_code == 200 and "could not record" in body.rsplit("event: ", 1)[1]


def test_a_template_that_refuses_a_conversation_is_a_400(
    fake: tuple[FakeVLLM, ServerThread], make_sidecar: Callable[..., Any], tmp_path: Path
) -> None:
    tok = load_tokenizer("tiny")
    strict = (
        "{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('no booms') }}"
        "{% endif %}{{ m.content }}{% endfor %}"
    )
    ChatTokenizer(tok.tokenizer, strict, tok.special_tokens).save(tmp_path / "strict")
    side = make_sidecar((fake[1].url,), tokenizer=str(tmp_path / "strict"))
    resp = httpx.post(side.url + "/v1/responses", json={"model": "smol", "input": "boom"})
    assert "no booms" in assert_shape("responses", resp, 400)
    ok = httpx.post(side.url + "/v1/responses", json={"model": "smol", "input": "fine"})
    assert ok.status_code == 200


def test_a_client_that_leaves_mid_stream_is_recorded(
    fake: tuple[FakeVLLM, ServerThread], tokenin: Any
) -> None:
    fake[0].delay_s = 0.2
    body = {"model": "smol", "input": "hi", "max_output_tokens": 30, "stream": True}
    with httpx.stream("POST", tokenin.base("gone") + "/responses", json=body) as resp:
        next(resp.iter_raw())  # the opening events, then the harness goes away
    deadline = time.monotonic() + 30
    while not tokenin.store.count_calls("gone") and time.monotonic() < deadline:
        time.sleep(0.1)
    (call,) = tokenin.store.calls("gone")
    assert call.error == "client disconnected"


def test_model_lists_answer_in_each_clients_shape(
    sidecar: Any, make_sidecar: Callable[..., Any]
) -> None:
    ant = anthropic.Anthropic(base_url=f"{sidecar.url}/rollouts/m", api_key="k", max_retries=0)
    (model,) = list(ant.models.list())
    assert model.id == "smol" and model.type == "model"
    oai = openai.OpenAI(base_url=sidecar.base("m"), api_key="k", max_retries=0)
    assert [m.id for m in oai.models.list()] == ["smol"]  # the upstream's own list, unchanged
    dead = make_sidecar((f"http://127.0.0.1:{free_port()}",), retries=0)
    resp = httpx.get(dead.url + "/v1/models", headers={"anthropic-version": "2023-06-01"})
    assert "no upstream answered" in assert_shape("messages", resp, 502)
    with pytest.raises(NoUpstream):
        anthropic_list({"data": [{"name": "no id"}]})
