"""One rollout round: tasks × group size → harness runs → rollout records with rewards.

In: tasks, a launcher, a trace store and an evaluator. Out: the store holds a finished rollout
record per run (reward for succeeded runs; failed and timed-out runs marked, never scored), and a
`RoundResult` summarizes the round for the train loop's metrics.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from harnessrl.rollout.evaluators import Evaluate
from harnessrl.rollout.tasks import Launcher, RunResult, RunSpec, Task
from harnessrl.traces.schema import (
    TERMINAL_STATES,
    CallRecord,
    RolloutRecord,
    RolloutState,
    TraceStore,
)

STDERR_TAIL = 2000  # characters of a run's stderr kept in its rollout record

# What a reward the harness posted itself (POST /rollouts/{id}/reward) counts for.
POSTED_REWARD = {
    "keep": "a posted reward stands; the evaluator scores only runs that posted none",
    "ignore": "the evaluator scores every run; a posted reward is kept in info only",
    "require": "only posted rewards count; a run that posted none is marked failed",
}


@dataclass
class RoundResult:
    group_ids: list[str]
    results: list[RunResult]
    rewards: dict[str, float]  # rollout id → reward, succeeded runs only
    calls: int = 0
    duration_s: float = 0.0
    tasks: dict[str, Task] = field(default_factory=dict)  # rollout id → task

    @property
    def failed(self) -> int:
        return sum(1 for r in self.results if r.state != RolloutState.SUCCEEDED)

    @property
    def timed_out(self) -> int:
        return sum(1 for r in self.results if r.state == RolloutState.TIMED_OUT)

    def reward_mean(self, failed_as: float | None = None) -> float:
        """Mean reward of succeeded runs; with `failed_as`, failed runs count as that reward."""
        values = list(self.rewards.values())
        if failed_as is not None:
            values += [failed_as] * self.failed
        return sum(values) / len(values) if values else 0.0

    @property
    def pass_rate(self) -> float:
        """Fraction of all runs (failed ones included) that earned a full reward."""
        return sum(1 for v in self.rewards.values() if v >= 1.0) / max(1, len(self.results))


def plan_round(
    tasks: Sequence[Task],
    *,
    prefix: str,
    runs_per_task: int,
    base_url: Callable[[str], str],
    timeout_s: float,
    attempt: int = 0,
    reward: Callable[[str], tuple[str, str]] | None = None,
) -> list[RunSpec]:
    """`runs_per_task` runs of each task; the runs of one task share a group id.

    `reward`: rollout id → (URL, token) with which that run's harness may post its own reward.
    """
    specs = []
    for i, task in enumerate(tasks):
        group_id = f"{prefix}-g{i}"
        for j in range(runs_per_task):
            rid = f"{group_id}-r{j}"
            url, token = reward(rid) if reward is not None else ("", "")
            specs.append(
                RunSpec(rid, task, group_id, attempt, base_url(rid), timeout_s, url, token)
            )
    return specs


def sample_tasks(tasks: Sequence[Task], k: int, seed: int, step: int) -> list[Task]:
    """`k` distinct tasks for `step`, the same ones whenever the same step is replayed."""
    if k > len(tasks):
        raise ValueError(
            f"rollout.tasks_per_step={k} exceeds the {len(tasks)} train tasks; lower it or add tasks"
        )
    return random.Random(seed * 1_000_003 + step).sample(list(tasks), k)


def run_round(
    specs: list[RunSpec],
    launcher: Launcher,
    store: TraceStore,
    evaluate: Evaluate,
    posted_reward: str = "keep",
) -> RoundResult:
    """Create the rollout records, run every spec, then finish each record with its outcome.

    `posted_reward` (keep | ignore | require) says what a reward the harness posted itself
    counts for; see `POSTED_REWARD`.
    """
    if posted_reward not in POSTED_REWARD:
        raise ValueError(
            f"posted_reward must be one of {tuple(POSTED_REWARD)}, got {posted_reward!r}"
        )
    start = time.monotonic()
    now = time.time()
    for spec in specs:
        store.create_rollout(
            RolloutRecord(
                rollout_id=spec.rollout_id,
                task_id=spec.task.task_id,
                group_id=spec.group_id,
                attempt=spec.attempt,
                created_at=now,
                updated_at=now,
            )
        )
    results = launcher.run(specs)
    out = RoundResult(
        group_ids=list(dict.fromkeys(s.group_id for s in specs)),
        results=[],
        rewards={},
        tasks={s.rollout_id: s.task for s in specs},
    )
    for spec, result in zip(specs, results, strict=True):
        calls = store.calls(spec.rollout_id)
        out.calls += len(calls)
        record = _finish(store, spec, result, calls, evaluate, posted_reward)
        # The record's final word: a harness that reported itself, or posted no reward when
        # one was required, is counted as the store has it.
        out.results.append(replace(result, state=record.state))
        if record.state == RolloutState.SUCCEEDED and record.reward is not None:
            out.rewards[spec.rollout_id] = record.reward
    out.duration_s = time.monotonic() - start
    return out


def _finish(
    store: TraceStore,
    spec: RunSpec,
    result: RunResult,
    calls: Sequence[CallRecord],
    evaluate: Evaluate,
    posted_reward: str,
) -> RolloutRecord:
    info: dict[str, Any] = {"duration_s": round(result.duration_s, 3), "calls": len(calls)}
    if result.stderr:
        info["stderr_tail"] = result.stderr[-STDERR_TAIL:]
    record = store.rollout(spec.rollout_id)
    if record.state in TERMINAL_STATES:
        # The harness reported back itself (sidecar /finish); its word on the state stands.
        return record
    if record.state == RolloutState.QUEUED:
        store.transition(spec.rollout_id, RolloutState.RUNNING)
    posted = record.reward  # what the harness posted while it ran (POST /rollouts/{id}/reward)
    if posted is not None:
        info["posted_reward"] = posted
    if result.state != RolloutState.SUCCEEDED:
        # A failed run is never scored, not even by itself: a posted reward stays in info only.
        return store.transition(
            spec.rollout_id, result.state, reward=None, exit_code=result.exit_code, info=info
        )
    info["output"] = result.output[-500:]
    if posted is not None and posted_reward != "ignore":
        reward, info["reward_source"] = posted, "posted"
    elif posted_reward == "require":
        info["error"] = "the harness posted no reward (rollout.posted_reward=require)"
        return store.transition(
            spec.rollout_id, RolloutState.FAILED, exit_code=result.exit_code, info=info
        )
    else:
        evaluation = evaluate(spec.task, result, calls)
        info.update(evaluation.info, reward_source="evaluator")
        reward = float(evaluation.reward)
    return store.transition(
        spec.rollout_id,
        RolloutState.SUCCEEDED,
        reward=reward,
        exit_code=result.exit_code,
        info=info,
    )
