"""Acceptance: unmodified harness code on the official `openai` SDK runs through the sidecar, and
every call is stored with exactly the prompt ids, completion ids and logprobs the upstream sent;
against the fake vLLM and against the real embedded server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from fake_vllm import load_exchanges

from harnessrl.traces.schema import CallRecord

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
]
MESSAGES = [{"role": "user", "content": "Use the add tool to add 2 and 3."}]


def assert_matches_response(rec: CallRecord, resp: Any) -> None:
    assert rec.ok, rec.error
    assert list(rec.prompt_token_ids) == resp.prompt_token_ids
    assert len(rec.choices) == len(resp.choices)
    for got, want in zip(rec.choices, resp.choices, strict=True):
        assert list(got.token_ids) == want.token_ids
        assert list(got.logprobs) == [e.logprob for e in want.logprobs.content]
        assert got.finish_reason == want.finish_reason


def assert_matches_stream(rec: CallRecord, chunks: list[Any]) -> None:
    assert rec.ok, rec.error
    assert list(rec.prompt_token_ids) == chunks[0].prompt_token_ids
    for got in rec.choices:
        parts = [c for ch in chunks for c in ch.choices if c.index == got.index]
        assert list(got.token_ids) == [
            t for c in parts for t in (getattr(c, "token_ids", None) or [])
        ]
        lps = [e.logprob for c in parts if c.logprobs for e in c.logprobs.content or []]
        assert list(got.logprobs) == lps
        assert got.finish_reason == [c.finish_reason for c in parts if c.finish_reason][-1]


def test_sync_sdk_chat_stream_n2_and_completions(upstream_url: str, make_sidecar: Any) -> None:
    sidecar = make_sidecar((upstream_url,))
    client = openai.OpenAI(base_url=sidecar.base("sync"), api_key="sk-harness", max_retries=0)
    plain = client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=6)
    tools = client.chat.completions.create(
        model="smol", messages=MESSAGES, tools=TOOLS, n=2, max_tokens=6
    )
    stream = list(
        client.chat.completions.create(
            model="smol",
            messages=MESSAGES,
            tools=TOOLS,
            n=2,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    comp = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=5)
    calls = sidecar.store.calls("sync")
    assert [c.seq for c in calls] == [0, 1, 2, 3]
    assert_matches_response(calls[0], plain)
    assert_matches_response(calls[1], tools)
    assert len(tools.choices) == 2 and len(calls[2].choices) == 2
    assert_matches_stream(calls[2], stream)
    assert list(calls[3].choices[0].token_ids) == comp.choices[0].token_ids
    assert list(calls[3].choices[0].logprobs) == comp.choices[0].logprobs.token_logprobs
    assert list(calls[3].prompt_token_ids) == comp.choices[0].prompt_token_ids
    # The request as the upstream got it asked for token ids and logprobs.
    assert calls[0].request["return_token_ids"] is True and calls[0].request["logprobs"] is True
    assert calls[3].request["logprobs"] == 1


def test_embedded_server_reports_the_policy_version_it_served(
    embedded: str, make_sidecar: Any
) -> None:
    sidecar = make_sidecar((embedded,), policy_version=7)
    client = openai.OpenAI(base_url=sidecar.base("pv"), api_key="x", max_retries=0)
    client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=2)
    list(client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=2, stream=True))
    # The server's header names the weights that answered; it wins over the control API's 7.
    assert [c.policy_version for c in sidecar.store.calls("pv")] == [0, 0]


def test_tool_calls_are_captured_whole(sidecar: Any) -> None:
    """The fake answers with tool calls (a tiny random model would not): the streamed call's
    arguments are assembled from their fragments."""
    client = openai.OpenAI(base_url=sidecar.base("tools"), api_key="x", max_retries=0)
    tools = client.chat.completions.create(model="smol", messages=MESSAGES, tools=TOOLS, n=2)
    assert tools.choices[0].message.tool_calls[0].function.name == "add"
    assert tools.choices[0].finish_reason == "tool_calls" and len(tools.choices) == 2
    stream = list(
        client.chat.completions.create(
            model="smol", messages=MESSAGES, tools=TOOLS, n=2, stream=True
        )
    )
    calls = sidecar.store.calls("tools")
    assert_matches_response(calls[0], tools)
    assert_matches_stream(calls[1], stream)
    assembled = calls[1].response["choices"][0]["message"]["tool_calls"][0]["function"]
    assert json.loads(assembled["arguments"]) == {"a": 2, "b": 3}


def test_async_sdk_concurrent_rollouts(upstream_url: str, make_sidecar: Any) -> None:
    sidecar = make_sidecar((upstream_url,))

    async def harness(k: int) -> list[Any]:
        client = openai.AsyncOpenAI(base_url=sidecar.base(f"async-{k}"), api_key="x", max_retries=0)
        first = await client.chat.completions.create(
            model="smol", messages=MESSAGES, n=2, max_tokens=4
        )
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model="smol",
                messages=[*MESSAGES, {"role": "assistant", "content": "ok"}],
                max_tokens=4,
                stream=True,
            )
        ]
        await client.close()
        return [first, chunks]

    async def main() -> list[list[Any]]:
        return await asyncio.gather(*(harness(k) for k in range(4)))

    results = asyncio.run(main())
    for k, (first, chunks) in enumerate(results):
        calls = sidecar.store.calls(f"async-{k}")
        assert len(calls) == 2
        assert_matches_response(calls[0], first)
        assert_matches_stream(calls[1], chunks)


def test_plain_v1_uses_default_rollout(upstream_url: str, make_sidecar: Any) -> None:
    sc = make_sidecar((upstream_url,), default_rollout="pod-7")
    client = openai.OpenAI(base_url=sc.url + "/v1", api_key="x", max_retries=0)
    client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=2)
    assert [m.id for m in client.models.list()] == ["smol"]
    assert sc.store.count_calls("pod-7") == 1


SELECTED = [
    *load_exchanges("chat_two_turn")[:4],
    *(r for r in load_exchanges() if r["kind"] != "chat_two_turn"),
]


@pytest.mark.parametrize("row", SELECTED, ids=lambda r: r["kind"])
def test_recorded_vllm_exchanges_pass_byte_identical(sidecar: Any, row: dict[str, Any]) -> None:
    resp = httpx.post(sidecar.url + row["path"], json=row["request"], timeout=30)
    assert resp.status_code == row["status"]
    assert resp.content == row["response_raw"].encode()
    (rec,) = sidecar.store.calls("default")
    assert rec.status == row["status"]
    if row["status"] != 200:
        assert rec.error.startswith(f"upstream HTTP {row['status']}") and rec.choices == ()
        return
    assert rec.ok, rec.error
    if row["request"].get("stream"):
        events = [
            json.loads(b[6:]) for b in row["response_raw"].split("\n\n") if b.startswith("data: {")
        ]
        ids = [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])]
        assert list(rec.choices[0].token_ids) == ids
        return
    body = json.loads(row["response_raw"])
    assert rec.response == body
    for got, want in zip(rec.choices, body["choices"], strict=True):
        assert list(got.token_ids) == want["token_ids"]
        lps = want["logprobs"].get("token_logprobs") or [
            e["logprob"] for e in want["logprobs"]["content"]
        ]
        assert list(got.logprobs) == lps
    prompt = body.get("prompt_token_ids") or body["choices"][0]["prompt_token_ids"]
    assert list(rec.prompt_token_ids) == prompt
