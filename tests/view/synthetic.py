"""Rollouts written straight into a store for the viewer's tests: a long agent run, a planted break."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from harnessrl.traces.schema import CallRecord, Choice, EndpointKind, RolloutRecord, TraceStore

# Script in every form a page could let through: an element, a handler, a javascript: URL.
EVIL = (
    '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
    '<a href="javascript:window.__pwned = 3">x</a></textarea></pre>'
)


@dataclass(frozen=True)
class SmokeRun:
    out: Path
    store_url: str
    stdout: str
    live_page: str  # the rollout list fetched from the address train printed, while it ran


def call(
    rollout_id: str,
    prompt: list[int],
    completion: list[int],
    messages: list[dict[str, str]],
    text: str,
    version: int = 0,
) -> CallRecord:
    now = time.time()
    return CallRecord(
        rollout_id=rollout_id,
        seq=-1,
        started_at=now,
        finished_at=now + 0.01,
        endpoint=EndpointKind.CHAT,
        request={"model": "m", "messages": messages},
        response={
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": len(prompt)},
        },
        prompt_token_ids=tuple(prompt),
        choices=(
            Choice(
                0,
                tuple(completion),
                tuple(-0.01 * (i % 700) for i in range(len(completion))),
                "stop",
                text,
            ),
        ),
        policy_version=version,
        upstream="http://127.0.0.1:1",
        latency_ms=10.0,
        status=200,
    )


def long_rollout(
    store: TraceStore, rollout_id: str, calls: int = 200, tokens: int = 64_000
) -> None:
    """`calls` turns of an agent whose one sequence grows to `tokens` ids, half of them sampled."""
    store.create_rollout(RolloutRecord(rollout_id, "long-task", f"long-{rollout_id}"))
    store.transition(rollout_id, "running")
    per = tokens // calls // 2
    ids: list[int] = []
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are an agent. " * 20}]
    batch = []
    for k in range(calls):
        ids += [(7 * (k * per + i)) % 49_000 + 1 for i in range(per)]  # the tool's answer
        messages.append({"role": "user", "content": f"tool output {k}: " + "x" * (per * 3)})
        completion = [(11 * (k * per + i)) % 49_000 + 1 for i in range(per)]
        text = f"step {k}: " + "y" * (per * 3)
        batch.append(call(rollout_id, list(ids), completion, list(messages), text, version=k // 50))
        ids += completion
        messages.append({"role": "assistant", "content": text})
    store.add_calls(batch)
    store.transition(rollout_id, "succeeded", reward=1.0)


def planted_break(store: TraceStore, rollout_id: str) -> None:
    """Two calls; the second prompt edits an id of the harness's earlier context (id 6 → 77)."""
    store.create_rollout(RolloutRecord(rollout_id, "planted", f"planted-{rollout_id}"))
    store.transition(rollout_id, "running")
    first = list(range(1, 11))
    answer = [11, 12, 13]
    second = [*first[:5], 77, *first[6:], *answer, 20, 21, 22]
    msgs = [{"role": "user", "content": "hi"}]
    store.add_calls(
        [
            call(rollout_id, first, answer, msgs, "a"),
            call(rollout_id, second, [30, 31], msgs, "b"),
        ]
    )
    store.transition(rollout_id, "succeeded", reward=0.5)
