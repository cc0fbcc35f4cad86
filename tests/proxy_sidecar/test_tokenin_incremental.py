"""Incremental token-in rendering: cutting text before special tokens keeps its ids, the cache
of a rollout's segments gives the ids of rendering from scratch over growing (and rewritten)
conversations with tool calls and tool results, only new text is tokenized, the cache's bound,
and the tokens the cutter refuses, with the reason shown on the tokenizer itself."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
from dialect_server import tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

from harnessrl.model.tokenizer import ChatTokenizer
from proxy_sidecar.dialects import endpoint
from proxy_sidecar.dialects.call import Conversation
from proxy_sidecar.dialects.endpoint import TokenIn
from proxy_sidecar.dialects.tokens import Renderer, template_messages
from proxy_sidecar.prompts.segments import (
    Cutter,
    SegmentCache,
    Segments,
    Tokenize,
    cut_tokens,
)

# Qwen-style: tools in a system block, native tool calls, and a generation prompt unlike the
# assistant turn's own header, so the piece before the next spliced turn is new text.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}\n<tool_call>\n{{ c.function | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]
FRAGMENTS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_",
    "|>",
    "<tool_call>",
    "\n",
    " ",
    "  \n",
    "\t",
    "2024",
    "é",
    "日本語",
    "def f(x):",
    "assistant",
    '{"a": 1}',
    "\U0001f642",
)
TEXT = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=7).map("".join)
MARKER = re.compile("\u27e6ref-(\\d+)\u27e7")


@pytest.fixture(scope="module")
def renderers() -> dict[str, Renderer]:
    tok = tokenizer()
    tools = ChatTokenizer(tok.tokenizer, TOOLS_TEMPLATE, tok.special_tokens, tok.add_bos_token)
    return {"smollm2": Renderer(tok), "tools": Renderer(tools)}


def from_scratch(
    renderer: Renderer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    sampled: list[list[int] | None],
) -> tuple[int, ...]:
    """The ids token-in mode must give, computed the plain way: the template's text with the
    sampled turns cut out, each stretch between them tokenized whole."""
    tok = renderer.tokenizer
    spliced = [ids for ids in sampled if ids is not None]
    marked, n = [], 0
    for message, ids in zip(messages, sampled, strict=True):
        if ids is not None:
            message = {"role": "assistant", "content": f"\u27e6ref-{n}\u27e7"}
            n += 1
        marked.append(message)
    text = tok.render_chat(template_messages(marked, renderer.hermes), tools=tools)
    parts = MARKER.split(text)
    assert parts[1::2] == [str(i) for i in range(len(spliced))]  # the templates keep every turn
    out = tok.encode(parts[0], add_special_tokens=False)
    for ids, part in zip(spliced, parts[2::2], strict=True):
        out += ids
        if ids and ids[-1] in tok.eos_token_ids:
            part = part.removeprefix(tok.special_tokens["eos_token"] or "")
        out += tok.encode(part, add_special_tokens=False)
    return tuple(out)


@settings(max_examples=120, deadline=None)
@given(text=TEXT)
def test_cutting_before_special_tokens_keeps_the_ids(text: str) -> None:
    tok = tokenizer()
    cutter = Cutter(cut_tokens(tok.tokenizer, tok.chat_template or ""))
    assert cutter.tokens == ("<|im_end|>", "<|im_start|>")
    segments = cutter.cut(text)
    assert "".join(segments) == text and all(segments)
    ids = [i for s in segments for i in tok.encode(s, add_special_tokens=False)]
    assert ids == tok.encode(text, add_special_tokens=False)


STEP = st.fixed_dictionaries(
    {
        "sampled": st.booleans(),  # the sidecar produced the turn (its ids are spliced in)
        "ids": st.lists(st.integers(3, 49151), min_size=0, max_size=6),
        "eos": st.booleans(),  # the sampled ids end with <|im_end|>
        "content": TEXT,
        "calls": st.lists(
            st.fixed_dictionaries({"cmd": TEXT, "n": st.integers(0, 99)}), max_size=2
        ),
        "user": TEXT,  # a user message after the tool results (empty: none)
        "rewrite": st.sampled_from([None, 0, 1, 2]),  # an earlier message the harness edits
        "rollout": st.sampled_from(["a", "b"]),
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    template=st.sampled_from(["smollm2", "tools"]),
    system=TEXT,
    task=TEXT,
    steps=st.lists(STEP, min_size=1, max_size=6),
    max_bytes=st.sampled_from([0, 3000, 10**9]),
)
def test_incremental_prompts_equal_rendering_from_scratch(
    renderers: dict[str, Renderer],
    template: str,
    system: str,
    task: str,
    steps: list[dict[str, Any]],
    max_bytes: int,
) -> None:
    renderer = renderers[template]
    tools = TOOLS if template == "tools" else None
    cache = SegmentCache(max_bytes)  # two rollouts take turns; small bounds forget them
    start: list[dict[str, Any]] = [{"role": "user", "content": task}]
    if system:
        start.insert(0, {"role": "system", "content": system})
    rollouts: dict[str, tuple[list[dict[str, Any]], list[list[int] | None]]] = {
        r: (list(start), [None] * len(start)) for r in "ab"
    }
    for i, step in enumerate(steps):
        messages, sampled = rollouts[step["rollout"]]
        known = cache.get(step["rollout"])
        prompt = renderer.render(messages, tools, sampled, known)
        assert prompt.segments is not None
        cache.put(step["rollout"], prompt.segments)
        assert prompt.ids == from_scratch(renderer, messages, tools, sampled)
        assert prompt.ids == renderer.render(messages, tools, sampled).ids
        assert prompt.reused_turns == sum(ids is not None for ids in sampled)
        # The harness's next call: this call's answer, its tool results, maybe a user message.
        calls = [
            {
                "id": f"c{i}{k}",
                "type": "function",
                "function": {"name": "bash", "arguments": json.dumps(args)},
            }
            for k, args in enumerate(step["calls"])
        ]
        turn: dict[str, Any] = {"role": "assistant", "content": step["content"]}
        if calls:
            turn["tool_calls"] = calls
        ids = [*step["ids"], 2] if step["eos"] else step["ids"]
        messages.append(turn)
        sampled.append(ids if step["sampled"] else None)
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": step["user"]})
            sampled.append(None)
        if step["user"] or not calls:
            messages.append({"role": "user", "content": step["user"] + str(i)})
            sampled.append(None)
        if step["rewrite"] is not None and sampled[step["rewrite"]] is None:
            # A history rewrite: compaction or an edit of an earlier message.
            old = messages[step["rewrite"]]
            messages[step["rewrite"]] = {**old, "content": f"(edited) {old['content']}"}
    # The last state of each, once more, given a's segments: cached text is valid in any rollout.
    for messages, sampled in rollouts.values():
        prompt = renderer.render(messages, tools, sampled, cache.get("a"))
        assert prompt.ids == from_scratch(renderer, messages, tools, sampled)


class CountingTokenizer:
    """The real tokenizer, counting the text it is given to tokenize (test double)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.chars = 0

    def encode_batch_fast(self, texts: list[str], add_special_tokens: bool) -> Any:
        self.chars += sum(map(len, texts))
        return self.tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

    def get_vocab(self, with_added_tokens: bool) -> dict[str, int]:
        return self.tok.get_vocab(with_added_tokens=with_added_tokens)


def test_a_growing_conversation_tokenizes_only_its_new_text() -> None:
    tok = tokenizer()
    counting = CountingTokenizer(tok.tokenizer)
    tokenize = Tokenize(counting, Cutter(("<|im_end|>", "<|im_start|>")))
    long = "The harness reads the file and runs the tests. " * 400
    history = f"<|im_start|>user\n{long}<|im_end|>\n"
    (ids,), first = tokenize([history + "<|im_start|>assistant\n"], None)
    assert counting.chars == len(history) + len("<|im_start|>assistant\n")
    # No sampled turns to splice: the whole prompt is one piece, cut before each special token.
    history += "<|im_start|>assistant\nok<|im_end|>\n<|im_start|>user\nrun it<|im_end|>\n"
    counting.chars = 0
    (grown,), second = tokenize([history + "<|im_start|>assistant\n"], first.ids)
    new = "<|im_start|>assistant\nok" + "<|im_start|>user\nrun it"  # segments never seen
    assert counting.chars == len(new)
    assert list(grown) == tok.encode(history + "<|im_start|>assistant\n", add_special_tokens=False)
    prompt = len(tok.encode("<|im_start|>assistant\n", add_special_tokens=False))
    assert grown[: len(ids) - prompt] == ids[:-prompt]  # the old prompt, bar its generation prompt
    counting.chars = 0
    # The same prompt again (a retried call): nothing is tokenized, the piece is reused whole.
    again, _ = tokenize([history + "<|im_start|>assistant\n"], second.ids)
    assert counting.chars == 0 and again == [grown]


def test_the_segment_cache_forgets_the_least_recent_rollouts_past_its_bound() -> None:
    def segments(nbytes: int) -> Segments:
        return Segments({"x" * nbytes: (1,)}, nbytes)

    cache = SegmentCache(max_bytes=100)
    cache.put("r1", segments(50))
    cache.put("r1", segments(40))  # a rollout's next call replaces its segments
    assert cache.held == 40 and len(cache) == 1
    cache.put("r2", segments(30))
    assert cache.get("r1") is not None  # r1 is now the most recent
    cache.put("r3", segments(50))  # 120 bytes: r2, least recently used, goes
    assert cache.get("r2") is None and cache.held == 90 and len(cache) == 2
    cache.put("r4", segments(500))  # past the bound alone: kept, the others go
    assert len(cache) == 1 and cache.get("r4") is not None and cache.held == 500
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        SegmentCache(-1)


def test_tokens_that_tokenizing_could_cross_are_not_cut_at() -> None:
    base = tokenizer().tokenizer
    tok = Tokenizer.from_str(base.to_str())
    tok.add_special_tokens(
        [
            AddedToken("<L>", lstrip=True, special=True, normalized=False),
            AddedToken("<S>", single_word=True, special=True, normalized=False),
            AddedToken("<A>", special=True, normalized=False),
            AddedToken("x<A", special=True, normalized=False),  # could match across a cut
            AddedToken("<B>", special=True, normalized=False),
        ]
    )
    template = "<L> <S> <A> <B> <|im_start|> <|im_end|> <|endoftext|>"
    assert cut_tokens(tok, template) == ("<B>", "<|endoftext|>", "<|im_end|>", "<|im_start|>")
    assert cut_tokens(tok, "<B>") == ("<B>",)  # only tokens the template uses

    def apart(a: str, b: str) -> list[int]:
        return (
            tok.encode(a, add_special_tokens=False).ids
            + tok.encode(b, add_special_tokens=False).ids
        )

    # Why each is left out: cut there, the ids would differ from the whole text's.
    assert apart("a ", "<L>") != tok.encode("a <L>", add_special_tokens=False).ids
    assert apart("ax", "<A>") != tok.encode("ax<A>", add_special_tokens=False).ids
    assert apart("a ", "<B>") == tok.encode("a <B>", add_special_tokens=False).ids


def test_token_in_renders_long_work_on_a_thread_and_keeps_each_rollouts_segments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokenizer()  # skips without the shipped tokenizer
    hops: list[str] = []
    real = asyncio.to_thread

    async def to_thread(fn: Any, *args: Any) -> Any:
        hops.append(fn.__name__)
        return await real(fn, *args)

    monkeypatch.setattr(endpoint.asyncio, "to_thread", to_thread)
    tokenin = TokenIn()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the test."}]

    async def call(rollout: str) -> tuple[int, ...]:
        hops.clear()
        prompt = await tokenin.prompt(rollout, Conversation(messages, TOOLS))
        assert tokenin.renderer is not None
        expected = tokenin.renderer.render(messages, TOOLS, [None] * len(messages)).ids
        assert prompt.ids == expected
        return prompt.ids

    async def run() -> None:
        await tokenin.load("tiny")
        hops.clear()
        await call("r")
        assert hops == []  # short: rendered and tokenized on the event loop
        messages.append({"role": "user", "content": "log: " + "x = f(1)\n" * 1000})
        await call("r")
        assert hops == ["finish"]  # 9k new characters: tokenized on a thread
        await call("r")
        assert hops == []  # the same again: nothing left to tokenize
        messages.extend({"role": "user", "content": f"go {i}"} for i in range(300))
        await call("r")
        assert hops == ["prepare", "finish"]  # 302 messages: the template runs on a thread
        await call("r")
        assert hops == ["prepare"]  # their text is known now
        await call("other")
        assert hops == ["prepare", "finish"]  # a new rollout tokenizes everything
        assert len(tokenin.segments) == 2

    asyncio.run(run())
