"""Opt-in tier: chat token-in mode against a real vLLM server (CPU build), beside pass-through.

The same multi-turn chats, sampled at temperature 1, go through two sidecars in front of one vLLM:
one passing chat through (vLLM re-renders the echoed text, which can re-tokenize it differently),
one in token-in mode (`--token-in-chat`, the sampled ids spliced back). Each rollout's calls are
merged; token-in mode must give no prefix break, and the text the harness got must be the
detokenized sampled ids. Prints `tokenin_vllm: chats=.. passthrough_breaks=.. tokenin_breaks=..`.
Needs HARNESSRL_VLLM_PYTHON=.venv-vllm/bin/python (`make vllm-env`), like the tier it reuses.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

# The tier's marks (vllm, its timeout, the skip without a vLLM) and its vLLM fixture.
from test_sidecar_real_vllm import VLLM_PY, pytestmark, vllm_url  # noqa: F401

from harnessrl.data.merge import merge_calls
from harnessrl.model.tokenizer import ChatTokenizer

CHATS, TURNS, MAX_TOKENS, WORKERS = 100, 3, 32, 16
TOPICS = ["cats", "rivers", "bread", "chess", "rain", "maps", "bees", "trains", "salt", "moons"]
ASKS = [
    "Write two short paragraphs about {}.",
    "List three facts about {}, one per line.",
    "Give a title, a blank line, then one sentence about {}.",
    "Describe {} in a short poem of two stanzas.",
]
FOLLOW = ["Now say it differently, in two paragraphs.", "Add one more line.", "Summarize that."]


def run_chat(client: openai.OpenAI, index: int, stream: bool) -> list[str]:
    """One chat of TURNS turns; the replies the harness got, echoed back unchanged."""
    ask = ASKS[index % len(ASKS)].format(TOPICS[index % len(TOPICS)])
    messages: list[Any] = [{"role": "user", "content": ask}]
    replies = []
    for turn in range(TURNS):
        kw: dict[str, Any] = dict(model="smol", messages=messages, max_tokens=MAX_TOKENS)
        if stream:
            chunks = client.chat.completions.create(stream=True, temperature=1.0, **kw)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            reply = client.chat.completions.create(temperature=1.0, **kw)
            text = reply.choices[0].message.content or ""
        replies.append(text)
        messages.append({"role": "assistant", "content": text})
        messages.append({"role": "user", "content": FOLLOW[turn % len(FOLLOW)]})
    return replies


def test_token_in_chat_has_no_prefix_breaks(
    vllm_url: str,  # noqa: F811
    make_sidecar: Callable[..., Any],
) -> None:
    hf = Path(str(VLLM_PY)).absolute().parent.parent / "harnessrl-cache" / "smollm2-a"
    tok = ChatTokenizer.from_hf_folder(hf)  # the files vLLM itself serves with
    sidecars = {
        "passthrough": make_sidecar((vllm_url,)),
        "tokenin": make_sidecar((vllm_url,), tokenizer=str(hf), token_in_chat=True),
    }
    jobs = [(mode, i) for i in range(CHATS) for mode in sidecars]
    started = time.monotonic()

    def job(mode: str, i: int) -> list[str]:
        client = openai.OpenAI(
            base_url=sidecars[mode].base(f"{mode}-{i}"), api_key="x", max_retries=0, timeout=600
        )
        return run_chat(client, i, stream=i % 2 == 1)

    with ThreadPoolExecutor(WORKERS) as pool:
        got = dict(zip(jobs, pool.map(lambda j: job(*j), jobs), strict=True))
    wall = time.monotonic() - started
    breaks = dict.fromkeys(sidecars, 0)
    broken = dict.fromkeys(sidecars, 0)
    mismatched = dict.fromkeys(sidecars, 0)
    causes: Counter[str] = Counter()
    for (mode, i), replies in got.items():
        calls = sidecars[mode].store.calls(f"{mode}-{i}")
        assert len(calls) == TURNS and all(c.ok for c in calls), [c.error for c in calls]
        if mode == "tokenin":  # every earlier reply came back as its sampled ids
            assert [c.response["token_in"]["reused_turns"] for c in calls] == list(range(TURNS))
        merged = merge_calls(calls, decode=tok.decode)
        breaks[mode] += len(merged.breaks)
        broken[mode] += bool(merged.breaks)
        causes.update(f"{mode}:{b.cause.value}" for b in merged.breaks)
        for call, text in zip(calls, replies, strict=True):
            ids = list(call.choices[0].token_ids)
            mismatched[mode] += text != tok.decode(ids, skip_special_tokens=True)
    print(
        f"\ntokenin_vllm: chats={CHATS} turns={TURNS} max_tokens={MAX_TOKENS} temperature=1 "
        f"passthrough_breaks={breaks['passthrough']} passthrough_chats_broken="
        f"{broken['passthrough']} causes={','.join(f'{k}={n}' for k, n in sorted(causes.items())) or '-'} "
        f"tokenin_breaks={breaks['tokenin']} tokenin_text_mismatches={mismatched['tokenin']} "
        f"passthrough_text_mismatches={mismatched['passthrough']} calls={len(jobs) * TURNS} "
        f"wall_s={wall:.0f}"
    )
    assert breaks["tokenin"] == 0
    assert mismatched["tokenin"] == 0
