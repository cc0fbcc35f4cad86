"""Token-in pieces on their own: tokenizer sources, the renderer's splicing and its fallbacks,
the ledger's bound, the streamed text splitter, and both dialects' event writers checked against
the official SDKs' own event and object models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from dialect_server import tokenizer
from openai.types.responses import Response, ResponseStreamEvent

from harnessrl.model.tokenizer import ChatTokenizer
from proxy_sidecar.dialects.call import Completion, number, split_output
from proxy_sidecar.dialects.messages import Messages
from proxy_sidecar.dialects.responses import Responses
from proxy_sidecar.dialects.sse import SSEReader, TextSplitter
from proxy_sidecar.dialects.tokens import Renderer, TurnLedger, load_tokenizer, turn_key
from proxy_sidecar.errors import BadRequest

CALL = {"type": "function", "function": {"name": "add", "arguments": '{"b": 3, "a": 2}'}}
# A template that knows tool calls (Qwen-style), and one that drops every assistant turn.
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FORGETFUL = (
    "{% for m in messages %}{% if m.role != 'assistant' %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}<|im_start|>assistant\n"
)


def with_template(tok: ChatTokenizer, template: str) -> ChatTokenizer:
    return ChatTokenizer(tok.tokenizer, template, tok.special_tokens, tok.add_bos_token)


def test_tokenizer_sources(tmp_path: Path) -> None:
    tok = tokenizer()
    tok.save(tmp_path / "hf")
    again = load_tokenizer(str(tmp_path / "hf"))
    assert again.encode("Hello there") == tok.encode("Hello there")
    assert again.chat_template == tok.chat_template
    with pytest.raises(ValueError, match="neither"):
        load_tokenizer(str(tmp_path / "missing"))


def test_turn_keys_match_across_argument_spellings() -> None:
    spaced = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    tight = {
        "content": None,
        "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
    }
    assert turn_key(spaced) == turn_key(tight)
    odd = {"content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}
    assert "{not json" in turn_key(odd)


def test_the_ledger_forgets_the_least_recent_rollouts_past_its_bound() -> None:
    ledger = TurnLedger(max_ids=10)
    turn = {"role": "assistant", "content": "a"}
    ledger.add("r1", turn, [1, 2, 3, 4, 5, 6])
    ledger.add("r1", turn, [1, 2, 3, 4])  # the same turn again replaces its ids
    assert ledger.held == 4
    ledger.add("r2", turn, [7] * 5)
    assert ledger.find("r1", turn) is not None  # r1 is now the most recent
    ledger.add("r3", turn, [8] * 5)  # 14 ids: r2, least recently used, goes
    assert ledger.find("r2", turn) is None and ledger.held == 9
    assert list(ledger.find("r3", turn) or []) == [8] * 5
    assert ledger.find("r1", {"role": "assistant", "content": "b"}) is None


def test_rendered_tool_calls_use_the_template_or_hermes_text() -> None:
    tok = tokenizer()
    messages = [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c", "content": "5"},
    ]
    hermes = Renderer(tok)  # SmolLM2's template knows no tool calls
    assert hermes.hermes
    text = tok.decode(list(hermes.render(messages, None, [None] * 3).ids))
    assert '<tool_call>\n{"name": "add", "arguments": {"b": 3, "a": 2}}\n</tool_call>' in text
    native = Renderer(with_template(tok, TOOL_TEMPLATE))
    assert not native.hermes
    prompt = native.render(messages, None, [None] * 3)
    assert prompt.rendered_turns == 1 and prompt.reused_turns == 0
    assert '<tool_call>{"name": "add", "arguments": {"b": 3, "a": 2}}</tool_call>' in tok.decode(
        list(prompt.ids)
    )


def test_sampled_ids_are_spliced_in_and_a_template_that_drops_turns_falls_back() -> None:
    tok = tokenizer()
    renderer = Renderer(tok)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    sampled = [*tok.encode("yo!", add_special_tokens=False), 2]  # what the policy really said
    prompt = renderer.render(messages, None, [None, sampled])
    head = renderer.render(messages[:1], None, [None]).ids
    assert prompt.ids[: len(head)] == head
    assert prompt.ids[len(head) : len(head) + len(sampled)] == tuple(sampled)
    assert prompt.reused_turns == 1
    # The sampled EOS ends the turn: the template's own <|im_end|> is not added again.
    assert prompt.ids[len(head) + len(sampled) :] == tuple(
        tok.encode("\n<|im_start|>assistant\n", add_special_tokens=False)
    )
    forgetful = Renderer(with_template(tok, FORGETFUL))
    fallback = forgetful.render(messages, None, [None, sampled])
    assert fallback.reused_turns == 0 and fallback.rendered_turns == 1
    reversed_order = Renderer(
        with_template(tok, "{% for m in messages | reverse %}{{ m.content }}|{% endfor %}")
    )
    two = [*messages, {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}]
    assert reversed_order.render(two, None, [None, sampled, None, [5]]).reused_turns == 0


def test_split_output_and_the_streamed_splitter_agree() -> None:
    text = '<think>plan it</think>\n\nSure.<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    reasoning, content, calls = split_output(text, tools=True)
    assert (reasoning, content) == ("plan it", "Sure.")
    assert calls[0]["name"] == "add" and json.loads(calls[0]["arguments"]) == {"a": 1}
    assert split_output(text, tools=False)[1].startswith("Sure.<tool_call>")
    splitter = TextSplitter(tools=True)
    shown = [splitter.feed(text[i : i + 3]) for i in range(0, len(text), 3)]
    assert "".join(r for r, _ in shown) == "plan it"
    assert "".join(c for _, c in shown) == "Sure."
    plain = TextSplitter(tools=False)
    assert plain.feed("<th") == ("", "")  # might still open a reasoning block
    assert plain.feed("ey") == ("", "<they")
    blank = TextSplitter(tools=True)
    assert blank.feed("  ") == ("", "") and blank.feed("<tool") == ("", "")


def test_sse_reader_splits_events_across_chunks() -> None:
    reader = SSEReader()
    assert reader.feed(b'data: {"a": 1}\n\ndata: {"b"') == [b'{"a": 1}']
    assert reader.feed(b": 2}\r\n\r\n") == [b'{"b": 2}']


def test_numbers_are_checked() -> None:
    assert number({}, "x") is None
    for bad in (float("inf"), True, "1", -1):
        with pytest.raises(BadRequest):
            number({"x": bad}, "x")
    with pytest.raises(BadRequest):
        number({"x": 1.5}, "x", integer=True)


def done(
    reasoning: str | None, content: str | None, calls: int, finish: str = "stop"
) -> Completion:
    tool_calls = [
        {"id": f"chatcmpl-tool-{i:024d}", "name": "add", "arguments": '{"a": 1}'}
        for i in range(calls)
    ]
    return Completion(
        (1, 2, 3), (4, 5), (-0.1, -0.2), "", finish, None, reasoning, content, tool_calls
    )


def events_of(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]


CASES = [
    ("streamed reasoning and text, then a call", ["r", "m"], done("think", "hi there", 1)),
    ("nothing streamed", [], done("think", "", 2)),
    ("an empty answer", [], done(None, "", 0, "length")),
    ("text only", ["m"], done(None, "hi there", 0)),
]


@pytest.mark.parametrize(("streamed", "final"), [(s, d) for _, s, d in CASES])
def test_response_events_are_what_the_openai_sdk_parses(
    streamed: list[str], final: Completion
) -> None:
    dialect = Responses()
    conv = dialect.parse(
        {"input": "x", "tools": [{"type": "function", "name": "add"}], "metadata": []}
    )
    writer = dialect.writer(conv, "smol", 3)
    raw = writer.start()
    for kind in streamed:
        kind = "reasoning" if kind == "r" else "message"
        text = final.reasoning if kind == "reasoning" else final.content
        raw += writer.delta(kind, (text or "")[:2])
    tail, reply = writer.finish(final)
    events = events_of(raw + tail)
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"] == reply
    Response.model_validate(reply)
    kinds = [item["type"] for item in reply["output"]]
    assert kinds.count("function_call") == len(final.tool_calls)
    assert reply["status"] == ("incomplete" if final.finish_reason == "length" else "completed")
    assert dialect.reply(conv, final, "smol")["output"][0]["type"] == kinds[0]


@pytest.mark.parametrize(("streamed", "final"), [(s, d) for _, s, d in CASES])
def test_message_events_are_what_the_anthropic_sdk_parses(
    streamed: list[str], final: Completion
) -> None:
    dialect = Messages()
    conv = dialect.parse(
        {"model": "smol", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    )
    writer = dialect.writer(conv, "smol", 3)
    raw = writer.start()
    for kind in streamed:
        kind = "reasoning" if kind == "r" else "message"
        text = final.reasoning if kind == "reasoning" else final.content
        raw += writer.delta(kind, (text or "")[:2])
    tail, reply = writer.finish(final)
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(RawMessageStreamEvent)
    events = [e for e in events_of(raw + tail) if e["type"] != "ping"]
    for event in events:
        adapter.validate_python(event)
    Message.model_validate(reply)
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert starts == stops == list(range(len(reply["content"])))  # one block open at a time
    assert (
        reply["stop_reason"]
        == {"stop": "tool_use" if final.tool_calls else "end_turn", "length": "max_tokens"}[
            final.finish_reason or "stop"
        ]
    )
    assert dialect.reply(conv, final, "smol")["content"][0]["type"] == reply["content"][0]["type"]


def test_messages_turns_become_chat_messages() -> None:
    conv = Messages().parse(
        {
            "model": "smol",
            "max_tokens": 4,
            "system": [{"type": "text", "text": "be brief"}],
            "stop_sequences": ["END"],
            "tool_choice": {"type": "none"},
            "tools": [{"name": "add", "input_schema": {}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": ""},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "1"}]},
                    {"type": "text", "text": "go on"},
                ]},
            ],
        }
    )  # fmt: skip
    assert conv.tools is None and conv.sampling["stop"] == ["END"]
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "tool", "user"]
    assert conv.messages[1]["content"] == "ab" and conv.messages[3]["content"] == "1"
    assert conv.messages[2]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'


def test_responses_items_become_chat_messages() -> None:
    dialect = Responses()
    conv = dialect.parse(
        {
            "input": [
                {"role": "developer", "content": "rules"},
                {"type": "function_call", "call_id": "c1", "name": "add", "arguments": {"a": 1}},
                {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}"},
                {"type": "reasoning", "summary": []},
                {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "1"}]},
            ],
            "tool_choice": "none",
            "tools": [{"type": "function", "name": "add", "description": "adds", "parameters": {}}],
        }
    )  # fmt: skip
    assert conv.tools is None
    assert [m["role"] for m in conv.messages] == ["system", "assistant", "tool"]
    assert [c["id"] for c in conv.messages[1]["tool_calls"]] == ["c1", "c2"]
    named = dialect.parse({"input": "x", "tools": [{"type": "function", "name": "add"}],
                           "tool_choice": {"type": "function", "name": "add"}})  # fmt: skip
    assert named.tools is not None
    for bad in ({"input": "x", "tools": [{"type": "function", "name": "f", "description": 1}]},
                {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": []}]},
                {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 3}]},
                {"input": [5]}):  # fmt: skip
        with pytest.raises(BadRequest):
            dialect.parse(bad)
