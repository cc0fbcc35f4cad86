"""Token-in rows of the sidecar benchmark: Responses and Messages calls (rendered and tokenized by
the sidecar) beside pass-through chat calls, at long contexts, against the benchmark's upstream.

In: a sidecar started with `--tokenizer smollm2` and the upstream it forwards to. Out: per context
size, the latency of each call direct and through the sidecar; the added time is the difference
(token-in calls are compared with the upstream's `/v1/completions` on the same token-id prompt).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from harnessrl.benchmarks.sidecar import COMPLETION, pct
from proxy_sidecar.dialects.tokens import Renderer, load_tokenizer

TOKENIZER = "smollm2"
SENTENCE = "The harness reads the file, runs the tests and patches the failing function. "
# Chat requests name their context size in the model (`smol-p16384`): the upstream cannot
# tokenize, yet its answer must carry as many prompt ids as vLLM's would.
MODEL_RE = re.compile(rb'"model":"smol-p(\d+)"')


def completions_body(request: dict[str, Any]) -> bytes:
    """A vLLM `/v1/completions` answer echoing the request's token-id prompt."""
    ids = COMPLETION
    prompt = request.get("prompt") or []
    choice = {
        "index": 0,
        "text": "".join(f"t{t}" for t in ids),
        "finish_reason": "length",
        "stop_reason": None,
        "prompt_token_ids": prompt,
        "token_ids": ids,
        "logprobs": {
            "text_offset": [0] * len(ids),
            "token_logprobs": [-0.1 - i / 7 for i in range(len(ids))],
            "tokens": [f"t{t}" for t in ids],
            "top_logprobs": [{f"t{t}": -0.1 - i / 7} for i, t in enumerate(ids)],
        },
    }
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}
    body = {"id": "cmpl-b", "object": "text_completion", "created": 1, "model": "smol"}
    return orjson.dumps({**body, "choices": [choice], "usage": usage})


def chat_prompt_len(request: bytes) -> int | None:
    """The context size a benchmark chat request names, or None for the fixed small answer."""
    found = MODEL_RE.search(request)
    return int(found.group(1)) if found else None


def context(tokens: int) -> str:
    """User text of about `tokens` SmolLM2 tokens."""
    per = len(load_tokenizer(TOKENIZER).encode(SENTENCE, add_special_tokens=False))
    return SENTENCE * max(1, tokens // per)


@dataclass
class Row:
    """One context size: latencies (ms) per call kind."""

    tokens: int
    lat: dict[str, list[float]] = field(default_factory=dict)


def requests(tokens: int) -> dict[str, tuple[str, bytes]]:
    """Per call kind: (path under the base, body), each with the same conversation."""
    text = context(tokens)
    messages = [{"role": "user", "content": text}]
    ids = Renderer(load_tokenizer(TOKENIZER)).render(messages, None, [None]).ids
    n = len(COMPLETION)
    chat = {"model": f"smol-p{len(ids)}", "messages": messages, "max_tokens": n}
    completions = {
        "model": "smol",
        "prompt": list(ids),
        "max_tokens": n,
        "logprobs": 1,
        "return_token_ids": True,
    }
    responses = {"model": "smol", "input": text, "max_output_tokens": n}
    anthropic = {"model": "smol", "messages": messages, "max_tokens": n}
    return {
        "chat": ("/chat/completions", orjson.dumps(chat)),
        "completions": ("/completions", orjson.dumps(completions)),
        "responses": ("/responses", orjson.dumps(responses)),
        "messages": ("/messages", orjson.dumps(anthropic)),
    }


# (row label, base: direct upstream or the sidecar, call kind)
LABELS = (
    ("direct chat", "direct", "chat"),
    ("sidecar chat", "sidecar", "chat"),
    ("direct completions", "direct", "completions"),
    ("sidecar responses", "sidecar", "responses"),
    ("sidecar messages", "sidecar", "messages"),
)


async def measure_tokenin(
    direct: str, sidecar: str, sizes: tuple[int, ...], calls: int, headers: dict[str, str]
) -> tuple[list[Row], int]:
    """`calls` calls of each kind per size, one client, the kinds taking turns call by call so
    other load on the machine hits them alike. Also returns how many went through the sidecar."""
    bases = {"direct": direct, "sidecar": sidecar}
    rows, through = [], 0
    async with aiohttp.ClientSession() as session:
        for tokens in sizes:
            row, bodies = Row(tokens), requests(tokens)
            for i in range(calls + 3):  # 3 warm-up rounds
                for label, base, kind in LABELS:
                    path, body = bodies[kind]
                    t0 = time.perf_counter()
                    async with session.post(bases[base] + path, data=body, headers=headers) as r:
                        await r.read()
                        if r.status != 200:
                            raise RuntimeError(f"{label} at {tokens}: HTTP {r.status}")
                    through += base == "sidecar"
                    if i >= 3:
                        row.lat.setdefault(label, []).append((time.perf_counter() - t0) * 1000)
            rows.append(row)
    return rows, through


def added(row: Row, label: str, q: float) -> float:
    """The sidecar's added ms at quantile q for a sidecar row, against its direct counterpart."""
    base = "direct chat" if label == "sidecar chat" else "direct completions"
    return pct(row.lat[label], q) - pct(row.lat[base], q)


def report_tokenin(rows: list[Row]) -> str:
    """Prints the token-in table; returns the final line's `key=value` fields."""
    print(
        f"{'context':<8} {'call':<20} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'+p50':>8} {'+p99':>8}"
    )
    for row in rows:
        for label, base, _ in LABELS:
            v = row.lat[label]
            plus = (
                f"{added(row, label, 0.5):>8.3f} {added(row, label, 0.99):>8.3f}"
                if base == "sidecar"
                else f"{'':>8} {'':>8}"
            )
            print(
                f"{row.tokens:<8} {label:<20} {len(v):>5} {pct(v, 0.5):>8.3f} "
                f"{pct(v, 0.99):>8.3f} {plus}"
            )
    fields = []
    for row in rows:
        k = f"{row.tokens // 1024}k" if row.tokens >= 1024 else str(row.tokens)
        tok50 = added(row, "sidecar responses", 0.5)
        pass50 = added(row, "sidecar chat", 0.5)
        fields += [
            f"tokenin_p50_ms_{k}={tok50:.3f}",
            f"tokenin_p99_ms_{k}={added(row, 'sidecar responses', 0.99):.3f}",
            f"messages_p50_ms_{k}={added(row, 'sidecar messages', 0.5):.3f}",
            f"passthrough_p50_ms_{k}={pass50:.3f}",
            f"passthrough_p99_ms_{k}={added(row, 'sidecar chat', 0.99):.3f}",
            f"tokenin_ratio_{k}={tok50 / max(pass50, 1e-3):.2f}",
        ]
    return " ".join(fields)
