"""Token-in mode, Messages dialect: the official `anthropic` SDK (`messages.create`,
`messages.stream`) runs unchanged through the sidecar to the embedded server with a tool; every
call is recorded with exact ids and logprobs, each prompt extending the previous call's ids."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import pytest
from anthropic.types import Message
from dialect_server import ADD_SCHEMA, prompt_length, scripted_server, tokenizer

from harnessrl.data.merge import merge_calls
from harnessrl.traces.schema import CallRecord

SYSTEM = "You are a careful calculator."
TOOLS: list[Any] = [{"name": "add", "description": "Add two integers", "input_schema": ADD_SCHEMA}]
FIRST: list[Any] = [{"role": "user", "content": "Use the add tool to add 2 and 3."}]


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    tok = tokenizer()
    start = prompt_length(tok, [{"role": "system", "content": SYSTEM}, *FIRST])
    handle = scripted_server(tok, start)
    yield handle.url
    handle.stop()


@pytest.fixture
def sidecar(upstream: str, make_sidecar: Callable[..., Any]) -> Any:
    return make_sidecar((upstream,), tokenizer="tiny")


def client_of(sidecar: Any, rollout: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=f"{sidecar.url}/rollouts/{rollout}", api_key="sk-ant-harness", max_retries=0
    )


def check_record(rec: CallRecord, reply: Any) -> None:
    assert rec.ok, rec.error
    assert rec.response is not None and rec.response["dialect"] == "messages"
    (choice,) = rec.choices
    assert len(choice.token_ids) == len(choice.logprobs) > 0
    assert reply.usage.input_tokens == len(rec.prompt_token_ids)
    assert reply.usage.output_tokens == len(choice.token_ids)
    assert rec.response["reply"]["id"] == reply.id
    Message.model_validate(rec.response["reply"])


def extends(later: CallRecord, earlier: CallRecord) -> bool:
    history = earlier.prompt_token_ids + earlier.choices[0].token_ids
    return later.prompt_token_ids[: len(history)] == history


def test_create_with_a_tool_over_turns(sidecar: Any) -> None:
    client = client_of(sidecar, "create")
    first = client.messages.create(
        model="smol", system=SYSTEM, messages=FIRST, tools=TOOLS, max_tokens=40
    )
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "add" and use.input == {"a": 2, "b": 3}
    history = [
        *FIRST,
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}],
        },
    ]
    second = client.messages.create(
        model="smol", system=SYSTEM, messages=history, tools=TOOLS, max_tokens=6
    )
    assert second.stop_reason == "max_tokens" and second.content[0].type == "text"
    calls = sidecar.store.calls("create")
    check_record(calls[0], first)
    check_record(calls[1], second)
    assert extends(calls[1], calls[0])
    merged = merge_calls(calls)
    assert not merged.breaks and len(merged.sequences) == 1


def test_stream_with_a_tool(sidecar: Any) -> None:
    client = client_of(sidecar, "stream")
    with client.messages.stream(
        model="smol", system=SYSTEM, messages=FIRST, tools=TOOLS, max_tokens=40
    ) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.input == {"a": 2, "b": 3} and first.stop_reason == "tool_use"
    history = [
        *FIRST,
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}],
        },
    ]
    with client.messages.stream(
        model="smol", system=SYSTEM, messages=history, tools=TOOLS, max_tokens=12
    ) as stream:
        deltas = [
            e.delta.text
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "text_delta"
        ]
        second = stream.get_final_message()
    assert len(deltas) > 1 and "".join(deltas) == second.content[0].text
    calls = sidecar.store.calls("stream")
    check_record(calls[0], first)
    check_record(calls[1], second)
    assert extends(calls[1], calls[0])
