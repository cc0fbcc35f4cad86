"""Token-in rows of the sidecar benchmark: an agent loop's growing conversation (each call adds
the function call the sidecar answered and its output) as Responses and Messages calls, rendered
and tokenized by the sidecar, beside pass-through chat calls of the same conversation.

In: a sidecar started with `--tokenizer smollm2` and the upstream it forwards to. Out: per context
size, the latency of each call direct and through the sidecar; the added time is, call by call,
the difference at the same conversation step (token-in calls are compared with the upstream's
`/v1/completions` on the same token-id prompt), and its percentiles are those differences'.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from harnessrl.benchmarks.sidecar import COMPLETION, paired_overhead, pct
from proxy_sidecar.dialects.tokens import Renderer, load_tokenizer

TOKENIZER = "smollm2"
SENTENCE = "The harness reads the file, runs the tests and patches the failing function. "
CODE_LINE = "    assert parse(rows, strict=True) == expected, f'row {i}: {rows[i]!r}'"
SYSTEM = "You are a coding agent. Call bash to read files and run the tests; stop when they pass."
TOOLS = [
    {
        "name": "bash",
        "description": "Run a shell command in the repository",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
    }
]
TURNS = 8  # measured calls per conversation, after the call that starts it
# Chat requests name their context size in the model (`smol-p16384`): the upstream cannot
# tokenize, yet its answer must carry as many prompt ids as vLLM's would.
MODEL_RE = re.compile(rb'"model":"smol-p(\d+)"')


def completions_body(request: dict[str, Any]) -> bytes:
    """A vLLM `/v1/completions` answer echoing the request's token-id prompt; its text calls
    bash with a command that names the prompt's length, so each turn of an agent loop differs."""
    ids = COMPLETION
    prompt = request.get("prompt") or []
    call = {"name": "bash", "arguments": {"cmd": f"sed -n {len(prompt)},+40p src/app.py"}}
    choice = {
        "index": 0,
        "text": f"<tool_call>\n{orjson.dumps(call).decode()}\n</tool_call>",
        "finish_reason": "stop",
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


def tool_output(tokens: int, start: int) -> str:
    """A file listing of about `tokens` tokens, its line numbers from `start`."""
    return "".join(f"{start + k:>5}{CODE_LINE}\n" for k in range(max(1, tokens // 36)))


@dataclass
class Row:
    """One context size: latencies (ms) per call kind, the token-id prompts sent."""

    tokens: int
    lat: dict[str, list[float]] = field(default_factory=dict)
    prompts: list[list[int]] = field(default_factory=list)  # of the measured calls


@dataclass
class Agent:
    """A growing agent conversation in chat form (what the sidecar renders), with the ids the
    sidecar sampled for each assistant turn it produced (None: rendered from text)."""

    messages: list[dict[str, Any]]
    sampled: list[list[int] | None]
    output: int  # tool output tokens per turn

    @classmethod
    def start(cls, tokens: int, renderer: Renderer) -> Agent:
        """System, a task of a quarter of the context, then earlier turns (calls and file
        listings, from before this sidecar) up to the context less half of the turns to come."""
        output = max(8, tokens // 64)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Fix the failing test.\n" + context(tokens // 4)},
        ]
        agent = cls(messages, [None] * len(messages), output)
        base = len(agent.prompt(renderer))
        earlier = cls(messages + agent.earlier(0), [None] * (len(messages) + 2), output)
        later = cls(earlier.messages, [*agent.sampled, list(COMPLETION), None], output)
        per_turn = len(earlier.prompt(renderer)) - base  # rendered from text
        per_call = len(later.prompt(renderer)) - base  # spliced in
        for k in range(max(0, (tokens - base - (TURNS + 1) * per_call // 2) // per_turn)):
            agent.messages += agent.earlier(k)
            agent.sampled += [None, None]
        return agent

    def earlier(self, k: int) -> list[dict[str, Any]]:
        call = orjson.dumps({"cmd": f"sed -n {40 * k},+40p src/app.py"}).decode()
        return _turn(f"call_p{k}", call, tool_output(self.output, 40 * k))

    def prompt(self, renderer: Renderer) -> list[int]:
        """The prompt the sidecar renders for it (here: from scratch)."""
        chat_tools = [{"type": "function", "function": t} for t in TOOLS]
        return list(renderer.render(self.messages, chat_tools, self.sampled).ids)

    def add(self, reply: bytes, step: int) -> None:
        """The sidecar's answer (a Responses reply with one function call) and its output."""
        (call,) = [i for i in orjson.loads(reply)["output"] if i["type"] == "function_call"]
        messages = _turn(call["call_id"], call["arguments"], tool_output(self.output, 40 * step))
        self.messages += messages
        self.sampled += [list(COMPLETION), None]

    def bodies(self, renderer: Renderer) -> tuple[list[int], dict[str, bytes]]:
        """The prompt the sidecar renders (from scratch), and each call kind's body."""
        chat_tools = [{"type": "function", "function": t} for t in TOOLS]
        ids = self.prompt(renderer)
        n = len(COMPLETION)
        system, history = self.messages[0]["content"], self.messages[1:]
        chat = {"model": f"smol-p{len(ids)}", "messages": self.messages, "tools": chat_tools}
        completions = {"model": "smol", "prompt": ids, "logprobs": 1, "return_token_ids": True}
        responses = {
            "model": "smol",
            "instructions": system,
            "input": [item for m in history for item in _responses_items(m)],
            "tools": [{"type": "function", **t} for t in TOOLS],
            "max_output_tokens": n,
        }
        anthropic = {
            "model": "smol",
            "system": system,
            "messages": _anthropic_turns(history),
            "tools": [
                {
                    "name": t["name"],
                    "description": t["description"],
                    "input_schema": t["parameters"],
                }
                for t in TOOLS
            ],
            "max_tokens": n,
        }
        raw = {"chat": {**chat, "max_tokens": n}, "completions": {**completions, "max_tokens": n}}
        raw.update(responses=responses, messages=anthropic)
        return ids, {kind: orjson.dumps(body) for kind, body in raw.items()}


def _turn(call_id: str, arguments: str, output: str) -> list[dict[str, Any]]:
    call = {"id": call_id, "type": "function", "function": {"name": "bash", "arguments": arguments}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": output},
    ]


def _responses_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    if message["role"] == "tool":
        return [
            {
                "type": "function_call_output",
                "call_id": message["tool_call_id"],
                "output": message["content"],
            }
        ]
    items = []
    if message["content"]:
        items.append({"type": "message", "role": message["role"], "content": message["content"]})
    for call in message.get("tool_calls") or ():
        fn = call["function"]
        items.append(
            {
                "type": "function_call",
                "call_id": call["id"],
                "name": fn["name"],
                "arguments": fn["arguments"],
            }
        )
    return items


def _anthropic_turns(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in history:
        if message["role"] == "assistant":
            blocks = [
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": call["function"]["name"],
                    "input": orjson.loads(call["function"]["arguments"]),
                }
                for call in message.get("tool_calls") or ()
            ]
            out.append({"role": "assistant", "content": blocks})
            continue
        block = {"type": "text", "text": message["content"]}
        if message["role"] == "tool":
            block = {
                "type": "tool_result",
                "tool_use_id": message["tool_call_id"],
                "content": message["content"],
            }
        if out and out[-1]["role"] == "user":
            out[-1]["content"].append(block)
        else:
            out.append({"role": "user", "content": [block]})
    return out


PATHS = {
    "chat": "/chat/completions",
    "completions": "/completions",
    "responses": "/responses",
    "messages": "/messages",
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
    """Per size, agent conversations of `TURNS` measured calls each (after one that starts them,
    and one whole conversation first, unmeasured) until `calls` calls of each kind. At each step
    every kind gets the same conversation, each through the sidecar in its own rollout, and the
    next step adds the function call the sidecar answered and its output. One client, the kinds
    taking turns call by call so other load on the machine hits them alike. Also returns how
    many calls went through the sidecar."""
    renderer = Renderer(load_tokenizer(TOKENIZER))
    root = sidecar.removesuffix("/v1")
    rows, through = [], 0
    async with aiohttp.ClientSession() as session:
        for tokens in sizes:
            row = Row(tokens)
            for conv in range(-(-calls // TURNS) + 1):
                agent = Agent.start(tokens, renderer)
                for step in range(TURNS + 1):
                    measured = conv > 0 and step > 0 and len(row.prompts) < calls
                    ids, bodies = agent.bodies(renderer)
                    reply = b""
                    for label, base, kind in LABELS:
                        if base == "direct":
                            url = direct + PATHS[kind]
                        else:
                            url = f"{root}/rollouts/bench-{tokens}-{conv}-{kind}/v1{PATHS[kind]}"
                        t0 = time.perf_counter()
                        async with session.post(url, data=bodies[kind], headers=headers) as r:
                            data = await r.read()
                            if r.status != 200:
                                raise RuntimeError(f"{label} at {tokens}: HTTP {r.status}")
                        through += base == "sidecar"
                        if measured:
                            row.lat.setdefault(label, []).append((time.perf_counter() - t0) * 1000)
                        if kind == "responses":
                            reply = data
                    if measured:
                        row.prompts.append(ids)
                    agent.add(reply, step)
            rows.append(row)
    return rows, through


def added(row: Row, label: str, q: float) -> float:
    """The sidecar's added ms at quantile q for a sidecar row: the quantile of each measured
    step's latency minus its direct counterpart's at the same step (`row.lat` is in step order)."""
    base = "direct chat" if label == "sidecar chat" else "direct completions"
    return paired_overhead(row.lat[label], row.lat[base], q)


def report_tokenin(rows: list[Row]) -> str:
    """Prints the token-in table; returns the final line's `key=value` fields."""
    print(
        f"{'context':<8} {'call':<20} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'+p50':>8} {'+p99':>8}"
    )
    for row in rows:
        sizes = sorted(map(len, row.prompts))
        print(
            f"{row.tokens:<8} prompts of {sizes[0]}..{sizes[-1]} tokens (median "
            f"{sizes[len(sizes) // 2]}), {TURNS} calls per conversation"
        )
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
