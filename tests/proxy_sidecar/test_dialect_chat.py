"""Token-in mode, Chat Completions dialect (`--token-in-chat`): the official `openai` SDK's
`client.chat.completions` runs unchanged through the sidecar to the embedded server, plain,
streamed and with a function tool over several turns; every call is recorded with exact ids and
logprobs, each prompt extends the previous call's ids, and the harness gets the sampled text."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from dialect_server import CHAT_TOOLS, prompt_length, scripted_server, tokenizer
from fake_vllm import FakeVLLM, ServerThread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion
from test_dialect_errors import assert_shape, json_values

from harnessrl.cli import to_argv
from harnessrl.data.merge import merge_calls
from harnessrl.traces.parse import parse_response
from harnessrl.traces.schema import CallRecord, EndpointKind
from proxy_sidecar.app import build_app
from proxy_sidecar.config import SidecarConfig, parse_args

SYSTEM = "You are a calculator. Use tools."
FIRST: list[Any] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Use the add tool to add 2 and 3."},
]
IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    tok = tokenizer()
    handle = scripted_server(tok, prompt_length(tok, FIRST))
    yield handle.url
    handle.stop()


@pytest.fixture
def sidecar(upstream: str, make_sidecar: Callable[..., Any]) -> Any:
    return make_sidecar((upstream,), tokenizer="tiny", token_in_chat=True)


def client_of(sidecar: Any, rollout: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=sidecar.base(rollout), api_key="sk-harness", max_retries=0)


def check_record(rec: CallRecord, reply: ChatCompletion) -> None:
    """The record holds the upstream's exact ids and logprobs; the reply shows the same ones."""
    assert rec.ok, rec.error
    assert rec.endpoint is EndpointKind.COMPLETIONS
    assert rec.response is not None and rec.response["dialect"] == "chat"
    prompt, choices = parse_response(EndpointKind.COMPLETIONS, rec.response)
    assert prompt == rec.prompt_token_ids and choices == rec.choices
    (choice,) = rec.choices
    (got,) = reply.choices
    assert got.model_extra is not None and tuple(got.model_extra["token_ids"]) == choice.token_ids
    assert reply.model_extra is not None
    assert tuple(reply.model_extra["prompt_token_ids"]) == rec.prompt_token_ids
    assert got.logprobs is not None and got.logprobs.content is not None
    assert tuple(e.logprob for e in got.logprobs.content) == choice.logprobs
    assert reply.usage is not None and reply.usage.prompt_tokens == len(rec.prompt_token_ids)
    assert reply.usage.completion_tokens == len(choice.token_ids)
    assert rec.response["reply"]["id"] == reply.id
    ChatCompletion.model_validate(rec.response["reply"])


def extends(later: CallRecord, earlier: CallRecord) -> bool:
    history = earlier.prompt_token_ids + earlier.choices[0].token_ids
    return later.prompt_token_ids[: len(history)] == history


def streamed(chunks: list[Any]) -> ChatCompletion:
    """The chunks of one stream folded into the completion they add up to."""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [
        i
        for c in chunks
        if c.choices
        for i in (c.choices[0].model_extra or {}).get("token_ids") or ()
    ]
    logprobs = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    prompt = next(
        c.model_extra["prompt_token_ids"]
        for c in chunks
        if (c.model_extra or {}).get("prompt_token_ids")
    )
    finish = next(
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    )
    (usage,) = [c.usage for c in chunks if c.usage is not None]
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "finish_reason": finish,
        "logprobs": {"content": [e.model_dump() for e in logprobs]},
        "token_ids": ids,
    }
    return ChatCompletion.model_validate(
        {"id": chunks[0].id, "object": "chat.completion", "created": chunks[0].created,
         "model": chunks[0].model, "choices": [choice], "usage": usage.model_dump(),
         "prompt_token_ids": prompt}
    )  # fmt: skip


def test_function_tool_over_several_turns_plain_and_streamed(sidecar: Any) -> None:
    client = client_of(sidecar, "tools")
    kw: dict[str, Any] = dict(model="smol", tools=CHAT_TOOLS, logprobs=True, extra_body=IDS)
    first = client.chat.completions.create(messages=FIRST, max_tokens=40, **kw)
    (choice,) = first.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    history: list[Any] = [*FIRST, choice.message]  # as the SDK's docs feed a reply back
    history.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
    chunks = list(
        client.chat.completions.create(
            messages=history,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            **kw,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) > 1  # not one blob
    second = streamed(chunks)
    assert second.choices[0].finish_reason == "length"
    history += [{"role": "assistant", "content": second.choices[0].message.content}]
    history.append({"role": "user", "content": "Thanks. Again?"})
    third = client.chat.completions.create(messages=history, max_tokens=6, **kw)
    calls = sidecar.store.calls("tools")
    assert len(calls) == 3
    for rec, reply in zip(calls, (first, second, third), strict=True):
        check_record(rec, reply)
        assert rec.request["messages"][1] == FIRST[1]  # the harness's own body
    # The text the harness got is the sampled text (the upstream's detokenized ids).
    assert second.choices[0].message.content == calls[1].choices[0].text
    assert third.choices[0].message.content == calls[2].choices[0].text
    assert extends(calls[1], calls[0]) and extends(calls[2], calls[1])
    assert [c.response["token_in"]["reused_turns"] for c in calls] == [0, 1, 2]
    merged = merge_calls(calls)
    assert not merged.breaks and len(merged.sequences) == 1
    assert merged.stats.sampled_tokens == sum(len(c.choices[0].token_ids) for c in calls)


def test_plain_chat_without_tools_or_logprobs(sidecar: Any) -> None:
    client = client_of(sidecar, "plain")
    messages: list[Any] = [{"role": "user", "content": "Say hi."}]
    first = client.chat.completions.create(model="smol", messages=messages, max_tokens=5)
    (choice,) = first.choices
    assert choice.logprobs is None and "token_ids" not in (choice.model_extra or {})
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    messages += [{"role": "assistant", "content": choice.message.content}]
    messages += [{"role": "user", "content": [{"type": "text", "text": "More."}]}]
    stream = client.chat.completions.stream(model="smol", messages=messages, max_tokens=5)
    with pytest.raises(openai.LengthFinishReasonError) as cut, stream as events:
        for _ in events:  # the SDK's own stream helper accumulates every chunk
            pass
        events.get_final_completion()  # refuses a length-cut reply, holding what it got
    final = cut.value.completion
    calls = sidecar.store.calls("plain")
    assert first.choices[0].message.content == calls[0].choices[0].text
    assert final.choices[0].message.content == calls[1].choices[0].text
    assert extends(calls[1], calls[0]) and calls[1].response["token_in"]["reused_turns"] == 1
    assert [c.choices[0].logprobs != () for c in calls] == [True, True]  # always recorded


BAD: list[tuple[Any, str]] = [
    (b"{nope", "not valid JSON"),
    ({"model": "smol"}, "messages must be a non-empty list"),
    ({"messages": [{"role": "function", "content": "x"}]}, "role must be"),
    ({"messages": [{"role": "user"}]}, "content is required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "'image_url' part"),
    ({"messages": [{"role": "tool", "content": "5"}]}, "tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]}, "string name"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n must be 1"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream must be"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [3]}, "stop must be"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]}, "function tool"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "maybe"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "functions": []}, "legacy"),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_object"},
        },
        "structured output",
    ),
]


@pytest.fixture
def tokenin(fake: tuple[FakeVLLM, ServerThread], make_sidecar: Callable[..., Any]) -> Any:
    return make_sidecar((fake[1].url,), tokenizer="tiny", token_in_chat=True)


def test_bad_bodies_are_400_in_openai_shape(tokenin: Any) -> None:
    for body, says in BAD:  # one sidecar for all: each case is one request
        content = body if isinstance(body, bytes) else orjson.dumps(body)
        resp = httpx.post(tokenin.url + "/v1/chat/completions", content=content)
        assert says in assert_shape("responses", resp, 400), body
    assert tokenin.store.count_calls() == 0  # refused before any upstream call


def test_the_switch_and_its_errors(
    fake: tuple[FakeVLLM, ServerThread], tokenin: Any, sidecar_off: Any
) -> None:
    body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for side, endpoint in ((tokenin, EndpointKind.COMPLETIONS), (sidecar_off, EndpointKind.CHAT)):
        resp = httpx.post(side.base("s") + "/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        (call,) = side.store.calls("s")
        assert call.endpoint is endpoint  # off: chat passes through as before
    with pytest.raises(ValueError, match="--tokenizer"):
        build_app(SidecarConfig(token_in_chat=True))
    with pytest.raises(SystemExit):
        parse_args(["--upstream", "http://127.0.0.1:1", "--token-in-chat"], env={})
    loop = to_argv(SidecarConfig(tokenizer="tiny", token_in_chat=True))  # the loop's own sidecar
    assert parse_args(loop, env={}).token_in_chat
    assert parse_args(
        ["--upstream", "http://x:1", "--token-in-chat", "--tokenizer", "tiny"], env={}
    ).token_in_chat


def test_upstream_failures_are_openai_errors_and_recorded(
    fake: tuple[FakeVLLM, ServerThread], tokenin: Any
) -> None:
    client = client_of(tokenin, "fail")
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="other", messages=messages, max_tokens=3)
    fake[0].drop_after_chunks = 2
    with pytest.raises(openai.APIError, match="mid-stream"):
        list(client.chat.completions.create(model="smol", messages=messages, stream=True))
    calls = tokenin.store.calls("fail")
    assert [c.status for c in calls] == [404, 200] and all(c.error for c in calls)


@pytest.fixture
def sidecar_off(fake: tuple[FakeVLLM, ServerThread], make_sidecar: Callable[..., Any]) -> Any:
    return make_sidecar((fake[1].url,), tokenizer="tiny")


message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | json_values},
    optional={
        "content": json_values
        | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "x"]), "text": json_values})),
        "tool_calls": json_values | st.lists(st.fixed_dictionaries(
            {"id": json_values, "function": st.fixed_dictionaries({}, optional={"name": json_values, "arguments": json_values})}
        ), max_size=2),
        "tool_call_id": json_values,
        "name": json_values,
    },
)  # fmt: skip
FIELDS = ["model", "tools", "tool_choice", "n", "max_tokens", "max_completion_tokens", "stop",
          "temperature", "top_p", "top_k", "seed", "logprobs", "top_logprobs", "return_token_ids",
          "stream_options", "response_format", "logit_bias"]  # fmt: skip


def test_fuzzed_bodies_never_500(tokenin: Any) -> None:
    client = httpx.Client(base_url=tokenin.url, timeout=30)
    good = {"model": "smol", "max_tokens": 3}

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        messages=st.lists(message, max_size=3),
        rest=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=4),
        stream=st.booleans(),
    )
    def check(messages: list[Any], rest: dict[str, Any], stream: bool) -> None:
        body = {**good, "messages": messages, **rest, "stream": stream}
        resp = client.post("/v1/chat/completions", content=orjson.dumps(body))
        if resp.status_code != 200:
            assert_shape("responses", resp)
        elif stream:
            assert resp.text.endswith("data: [DONE]\n\n") or '"error"' in resp.text

    check()
    client.close()
