"""The one response parser, on real recorded vLLM responses and on malformed ones."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from harnessrl.traces.parse import CaptureError, StreamAssembler, parse_response
from harnessrl.traces.schema import EndpointKind

FIXTURES = (
    pathlib.Path(__file__).parents[1] / "fixtures" / "vllm" / "vllm_cpu_smollm2_exchanges.jsonl"
)
ROWS = [json.loads(line) for line in FIXTURES.read_text().splitlines()]


def kind_of(row: dict[str, Any]) -> EndpointKind:
    return EndpointKind.CHAT if "chat" in row["path"] else EndpointKind.COMPLETIONS


def assemble(row: dict[str, Any]) -> dict[str, Any]:
    asm = StreamAssembler(kind_of(row))
    for block in row["response_raw"].encode().split(b"\n\n"):
        if block.startswith(b"data: "):
            asm.feed(block[6:])
    assert asm.done
    return asm.body()


@pytest.mark.parametrize(
    "row",
    [r for r in ROWS if r["status"] == 200 and not r["request"].get("stream")],
    ids=lambda r: r["kind"],
)
def test_non_streaming_recorded_responses(row: dict[str, Any]) -> None:
    body = json.loads(row["response_raw"])
    prompt, choices = parse_response(kind_of(row), body)
    if kind_of(row) is EndpointKind.CHAT:
        assert list(prompt) == body["prompt_token_ids"]
        for c, raw in zip(choices, body["choices"], strict=True):
            assert list(c.logprobs) == [e["logprob"] for e in raw["logprobs"]["content"]]
            assert c.text == raw["message"]["content"]
    else:
        assert list(prompt) == body["choices"][0]["prompt_token_ids"]
        assert list(choices[0].logprobs) == body["choices"][0]["logprobs"]["token_logprobs"]
    assert [list(c.token_ids) for c in choices] == [raw["token_ids"] for raw in body["choices"]]
    assert len(choices) == row["request"].get("n", 1)


@pytest.mark.parametrize(
    "row", [r for r in ROWS if r["request"].get("stream")], ids=lambda r: r["kind"]
)
def test_streams_assemble_to_the_same_ids(row: dict[str, Any]) -> None:
    body = assemble(row)
    prompt, choices = parse_response(kind_of(row), body)
    events = [
        json.loads(b[6:]) for b in row["response_raw"].split("\n\n") if b.startswith("data: {")
    ]
    ids = [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])]
    assert list(choices[0].token_ids) == ids
    assert len(choices[0].logprobs) == len(ids) and prompt
    assert choices[0].finish_reason == "length"
    text = "".join(
        (c.get("delta") or {}).get("content") or c.get("text") or ""
        for e in events
        for c in e["choices"]
    )
    assert choices[0].text == text


def test_tool_call_deltas_are_merged() -> None:
    asm = StreamAssembler(EndpointKind.CHAT)
    asm.feed(
        b'{"id":"x","choices":[{"index":0,"delta":{"role":"assistant"}}],"prompt_token_ids":[1,2]}'
    )
    asm.feed(
        b'{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c1","type":"function","function":{"name":"add","arguments":"{\\"a\\""}}]},"token_ids":[5],"logprobs":{"content":[{"logprob":-1.0}]}}]}'
    )
    asm.feed(
        b'{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":": 1}"}}]},"token_ids":[6],"logprobs":{"content":[{"logprob":-2.0}]},"finish_reason":"tool_calls"}]}'
    )
    asm.feed(b'{"error":{"message":"late"}}')
    asm.feed(b"[DONE]")
    body = asm.body()
    call = body["choices"][0]["message"]["tool_calls"][0]
    assert call == {
        "id": "c1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1}'},
    }
    prompt, choices = parse_response(EndpointKind.CHAT, body)
    assert (
        prompt == (1, 2) and choices[0].token_ids == (5, 6) and choices[0].logprobs == (-1.0, -2.0)
    )
    assert choices[0].finish_reason == "tool_calls" and asm.error == {"message": "late"}


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ([], "no 'choices'"),
        ({"choices": [1]}, "not an object"),
        ({"choices": [{"index": 0, "token_ids": []}]}, "no prompt_token_ids"),
        ({"prompt_token_ids": [1], "choices": [{"index": 0}]}, "no token_ids"),
        (
            {
                "prompt_token_ids": [1],
                "choices": [{"token_ids": [1, 2], "logprobs": {"content": [{"logprob": -1}]}}],
            },
            "2 token ids but 1",
        ),
        ({"prompt_token_ids": ["a"], "choices": []}, "list of integers"),
        (
            {
                "prompt_token_ids": [1],
                "choices": [{"token_ids": [1], "logprobs": {"content": [{"logprob": "-1.5"}]}}],
            },
            "non-numeric",
        ),
        (
            {
                "prompt_token_ids": [1],
                "choices": [{"token_ids": [1], "logprobs": {"content": [3]}}],
            },
            "not an object",
        ),
    ],
)
def test_malformed_chat_bodies(body: Any, match: str) -> None:
    with pytest.raises(CaptureError, match=match):
        parse_response(EndpointKind.CHAT, body)


def test_completions_with_batched_prompts_are_refused() -> None:
    body = {"choices": [{"index": i, "token_ids": [], "prompt_token_ids": [i]} for i in range(2)]}
    with pytest.raises(CaptureError, match="batched"):
        parse_response(EndpointKind.COMPLETIONS, body)


@pytest.mark.parametrize("data", [b"{", b"[1]", b'{"choices":[1]}', b'{"choices":[{"index":"a"}]}'])
def test_malformed_stream_events(data: bytes) -> None:
    with pytest.raises(CaptureError):
        StreamAssembler(EndpointKind.CHAT).feed(data)
