"""Build trace records for the data tests: single calls, and generated agent-like rollouts."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from hypothesis import strategies as st

from harnessrl.traces.schema import CallRecord, Choice, EndpointKind, RolloutRecord, RolloutState

_LOGPROB_IDS = itertools.count(1)


def unique_logprobs(n: int) -> tuple[float, ...]:
    """Distinct, exactly representable float32 logprobs: each sampled token is identifiable."""
    return tuple(-next(_LOGPROB_IDS) / 1024.0 for _ in range(n))


def make_call(
    rollout_id: str,
    seq: int,
    prompt: Sequence[int],
    completions: Sequence[Sequence[int]],
    *,
    logprobs: Sequence[Sequence[float]] | None = None,
    status: int = 200,
    error: str | None = None,
    version: int | None = 0,
) -> CallRecord:
    lps = logprobs if logprobs is not None else [unique_logprobs(len(c)) for c in completions]
    choices = tuple(
        Choice(k, tuple(c), tuple(lp), "stop")
        for k, (c, lp) in enumerate(zip(completions, lps, strict=True))
    )
    return CallRecord(
        rollout_id=rollout_id,
        seq=seq,
        started_at=0.0,
        finished_at=0.0,
        endpoint=EndpointKind.CHAT,
        request={},
        response={},
        prompt_token_ids=tuple(prompt),
        choices=choices if status < 300 else (),
        policy_version=version,
        upstream="test",
        latency_ms=0.0,
        status=status,
        error=error,
    )


def make_run(
    rollout_id: str,
    group_id: str,
    reward: float | None,
    state: RolloutState = RolloutState.SUCCEEDED,
) -> RolloutRecord:
    return RolloutRecord(rollout_id, group_id, group_id, state=state, reward=reward)


@dataclass
class GeneratedRun:
    run: RolloutRecord
    calls: list[CallRecord]
    # logprob -> rollout id of every sampled token that must be trained exactly once
    sampled: dict[float, str] = field(default_factory=dict)


@st.composite
def agent_run(draw: st.DrawFn, rollout_id: str, group_id: str, max_calls: int = 6) -> GeneratedRun:
    """A harness loop: each call either extends the running context (tool output appended) or
    starts over (a fresh context opened by a marker id nothing else uses). Some calls fail,
    some sample n=2 (the harness continues from choice 0), some repeat the last request."""
    tok = st.integers(min_value=3, max_value=999)
    context: list[int] = []
    calls: list[CallRecord] = []
    sampled: dict[float, str] = {}
    marker = 10_000  # markers only need to differ within one run
    last: CallRecord | None = None  # the latest successful call
    for seq in range(draw(st.integers(1, max_calls))):
        kind = draw(st.sampled_from(["extend", "extend", "extend", "restart", "fail", "retry"]))
        if kind == "retry" and last is not None:
            # The harness repeats its last request: that call's answers are superseded.
            prompt = list(last.prompt_token_ids)
            for choice in last.choices:
                for lp in choice.logprobs:
                    del sampled[lp]
        else:
            if kind == "restart" or not context:
                marker += 1
                context = [marker]
            prompt = context + draw(
                st.lists(tok, min_size=0 if len(context) > 1 else 1, max_size=12)
            )
        if kind == "fail":
            calls.append(make_call(rollout_id, seq, prompt, [], status=500, error="upstream error"))
            continue
        n = draw(st.sampled_from([1, 1, 1, 2]))
        comps = [draw(st.lists(tok, min_size=1, max_size=40)) for _ in range(n)]
        call = make_call(rollout_id, seq, prompt, comps)
        calls.append(call)
        for choice in call.choices:
            sampled.update(dict.fromkeys(choice.logprobs, rollout_id))
        context = prompt + comps[0]
        last = call
    reward = draw(st.sampled_from([0.0, 0.5, 1.0]))
    return GeneratedRun(make_run(rollout_id, group_id, reward), calls, sampled)


@st.composite
def agent_step(draw: st.DrawFn, max_groups: int = 3, max_group_size: int = 4) -> list[GeneratedRun]:
    runs = []
    for g in range(draw(st.integers(1, max_groups))):
        for k in range(draw(st.integers(1, max_group_size))):
            runs.append(draw(agent_run(f"g{g}-r{k}", f"g{g}")))
    return runs
