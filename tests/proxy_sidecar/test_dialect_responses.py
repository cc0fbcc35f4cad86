"""Token-in mode, Responses dialect: the official `openai` SDK's `client.responses` runs unchanged
through the sidecar to the embedded server, with a function tool over several turns; every call
is recorded with exact ids and logprobs, and each prompt extends the previous call's ids."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from dialect_server import ADD_SCHEMA, prompt_length, scripted_server, tokenizer
from openai.types.responses import Response

from harnessrl.data.diagnose import BreakCause
from harnessrl.data.merge import merge_calls
from harnessrl.traces.parse import parse_response
from harnessrl.traces.schema import CallRecord, EndpointKind

INSTRUCTIONS = "You are a calculator. Use tools."
TOOLS: list[Any] = [
    {"type": "function", "name": "add", "description": "Add two integers", "parameters": ADD_SCHEMA}
]
FIRST = [{"role": "user", "content": "Use the add tool to add 2 and 3."}]


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    tok = tokenizer()
    start = prompt_length(tok, [{"role": "system", "content": INSTRUCTIONS}, *FIRST])
    handle = scripted_server(tok, start)
    yield handle.url
    handle.stop()


@pytest.fixture
def sidecar(upstream: str, make_sidecar: Callable[..., Any]) -> Any:
    return make_sidecar((upstream,), tokenizer="tiny")


def client_of(sidecar: Any, rollout: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=sidecar.base(rollout), api_key="sk-harness", max_retries=0)


def check_record(rec: CallRecord, reply: Any) -> None:
    """The record holds the upstream's exact ids and logprobs, and the reply the harness got."""
    assert rec.ok, rec.error
    assert rec.endpoint is EndpointKind.COMPLETIONS
    assert rec.response is not None and rec.response["dialect"] == "responses"
    prompt, choices = parse_response(EndpointKind.COMPLETIONS, rec.response)
    assert prompt == rec.prompt_token_ids and choices == rec.choices
    (choice,) = rec.choices
    assert len(choice.token_ids) == len(choice.logprobs) > 0
    assert reply.usage.input_tokens == len(rec.prompt_token_ids)
    assert reply.usage.output_tokens == len(choice.token_ids)
    stored = rec.response["reply"]
    assert stored["id"] == reply.id
    Response.model_validate(stored)  # the SDK's own model accepts the whole object


def extends(later: CallRecord, earlier: CallRecord) -> bool:
    history = earlier.prompt_token_ids + earlier.choices[0].token_ids
    return later.prompt_token_ids[: len(history)] == history


def test_function_tool_over_several_turns(sidecar: Any) -> None:
    client = client_of(sidecar, "tools")
    first = client.responses.create(
        model="smol", instructions=INSTRUCTIONS, input=FIRST, tools=TOOLS, max_output_tokens=40
    )
    assert first.status == "completed"
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3}
    history: list[Any] = [*FIRST, *first.output]  # as the SDK's docs feed a response back
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "5"})
    second = client.responses.create(
        model="smol", instructions=INSTRUCTIONS, input=history, tools=TOOLS, max_output_tokens=6
    )
    assert second.status == "incomplete" and second.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in second.output] == ["message"]
    history += [*second.output, {"role": "user", "content": "Thanks. Again?"}]
    third = client.responses.create(
        model="smol", instructions=INSTRUCTIONS, input=history, tools=TOOLS, max_output_tokens=6
    )
    calls = sidecar.store.calls("tools")
    assert len(calls) == 3
    for rec, reply in zip(calls, (first, second, third), strict=True):
        check_record(rec, reply)
        assert rec.request["input"][0] == FIRST[0]  # the harness's own body
    # The sampled ids of each earlier turn are reused: zero drift, one training sequence.
    assert extends(calls[1], calls[0]) and extends(calls[2], calls[1])
    merged = merge_calls(calls)
    assert not merged.breaks and len(merged.sequences) == 1
    assert merged.stats.sampled_tokens == sum(len(c.choices[0].token_ids) for c in calls)


def test_previous_response_id_and_store_false(sidecar: Any) -> None:
    client = client_of(sidecar, "chained")
    first = client.responses.create(
        model="smol", instructions=INSTRUCTIONS, input=FIRST, tools=TOOLS, max_output_tokens=40
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    output = [{"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
    second = client.responses.create(
        model="smol",
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        input=output,
        tools=TOOLS,
        max_output_tokens=4,
        store=False,
    )
    calls = sidecar.store.calls("chained")
    assert extends(calls[1], calls[0])
    assert second.previous_response_id == first.id and second.store is False
    with pytest.raises(openai.BadRequestError) as err:  # store: false keeps nothing to chain on
        client.responses.create(model="smol", previous_response_id=second.id, input="more")
    assert err.value.body["param"] == "previous_response_id"


def test_streamed_turns_match_the_recorded_calls(sidecar: Any) -> None:
    client = client_of(sidecar, "streamed")
    with client.responses.stream(
        model="smol", instructions=INSTRUCTIONS, input=FIRST, tools=TOOLS, max_output_tokens=40
    ) as stream:
        kinds = [event.type for event in stream]  # the SDK's parser accumulates every event
        first = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    (call,) = [item for item in first.output if item.type == "function_call"]
    history: list[Any] = [*FIRST, *first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "5"})
    events = list(
        client.responses.create(
            model="smol",
            instructions=INSTRUCTIONS,
            input=history,
            tools=TOOLS,
            max_output_tokens=12,
            stream=True,
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1]
    assert final.type == "response.incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.response.output_text == text
    assert sum(e.type == "response.output_text.delta" for e in events) > 1  # not one blob
    calls = sidecar.store.calls("streamed")
    check_record(calls[0], first)
    check_record(calls[1], final.response)
    assert extends(calls[1], calls[0])
    assert calls[1].choices[0].text == text


def test_compacted_history_starts_a_new_sequence(sidecar: Any) -> None:
    """A harness that summarizes its history mid-run: the call after the rewrite starts a new
    sequence, diagnosed history_rewritten, and every sampled token is trained exactly once."""
    client = client_of(sidecar, "compact")
    kw: dict[str, Any] = dict(model="smol", instructions=INSTRUCTIONS, tools=TOOLS)
    first = client.responses.create(input=FIRST, max_output_tokens=40, **kw)
    (call,) = [item for item in first.output if item.type == "function_call"]
    history: list[Any] = [*FIRST, *first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "5"})
    second = client.responses.create(input=history, max_output_tokens=6, **kw)
    summary = "Earlier: add(2, 3) returned 5. State the result in one sentence."
    compacted = [{"role": "user", "content": summary}, *second.output]
    client.responses.create(input=compacted, max_output_tokens=6, **kw)
    calls = sidecar.store.calls("compact")
    assert [c.response["token_in"]["reused_turns"] for c in calls] == [0, 1, 1]
    assert extends(calls[1], calls[0]) and not extends(calls[2], calls[1])
    merged = merge_calls(calls)
    (diagnosis,) = merged.breaks
    assert diagnosis.call_seq == calls[2].seq and diagnosis.cause is BreakCause.HISTORY_REWRITTEN
    assert [s.call_seqs for s in merged.sequences] == [(0, 1), (2,)]
    trained = sum(s.num_sampled for s in merged.sequences)
    assert trained == merged.stats.sampled_tokens == sum(len(c.choices[0].token_ids) for c in calls)
