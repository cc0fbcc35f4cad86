"""One rollout round: tasks × group size → harness runs → rollout records with rewards.

In: tasks, a launcher, a trace store and an evaluator. Out: the store holds a finished rollout
record per run (reward for succeeded runs; failed and timed-out runs marked, never scored), and a
`RoundResult` summarizes the round for the train loop's metrics.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from harnessrl.rollout.evaluators import Evaluate, Evaluation
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
    infos: dict[str, dict[str, Any]] = field(default_factory=dict)  # rollout id → record info

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
    eval_workers: int = 1,
) -> RoundResult:
    """Create the rollout records, run every spec, then finish each record with its outcome.

    `posted_reward` (keep | ignore | require) says what a reward the harness posted itself
    counts for; see `POSTED_REWARD`. Up to `eval_workers` runs are evaluated at once (a grader
    that runs tests in a sandbox is slow; the built-in checks are instant).
    """
    if posted_reward not in POSTED_REWARD:
        raise ValueError(
            f"posted_reward must be one of {tuple(POSTED_REWARD)}, got {posted_reward!r}"
        )
    if isinstance(eval_workers, bool) or not isinstance(eval_workers, int) or eval_workers < 1:
        raise ValueError(f"eval_workers must be an integer >= 1, got {eval_workers!r}")
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
    opened: list[RolloutRecord | _Unscored] = []
    for spec, result in zip(specs, results, strict=True):
        calls = store.calls(spec.rollout_id)
        out.calls += len(calls)
        opened.append(_open(store, spec, result, calls, posted_reward))
    todo = [(i, o) for i, o in enumerate(opened) if isinstance(o, _Unscored)]
    scored = _evaluate_all(evaluate, [o for _, o in todo], eval_workers)
    for (i, pending), evaluation in zip(todo, scored, strict=True):
        opened[i] = _score(store, pending, evaluation)
    for result, record in zip(results, opened, strict=True):
        assert isinstance(record, RolloutRecord)
        # The record's final word: a harness that reported itself, or posted no reward when
        # one was required, or a grader that could not judge, is counted as the store has it.
        out.results.append(replace(result, state=record.state))
        out.infos[record.rollout_id] = record.info
        if record.state == RolloutState.SUCCEEDED and record.reward is not None:
            out.rewards[record.rollout_id] = record.reward
    out.duration_s = time.monotonic() - start
    return out


@dataclass
class _Unscored:
    """A succeeded run that the evaluator still has to score."""

    spec: RunSpec
    result: RunResult
    calls: Sequence[CallRecord]
    info: dict[str, Any]


def _open(
    store: TraceStore,
    spec: RunSpec,
    result: RunResult,
    calls: Sequence[CallRecord],
    posted_reward: str,
) -> RolloutRecord | _Unscored:
    """Finish every run that needs no evaluator; the others come back unscored."""
    info: dict[str, Any] = {
        **result.info,
        "duration_s": round(result.duration_s, 3),
        "calls": len(calls),
    }
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
        info["reward_source"] = "posted"
        return store.transition(
            spec.rollout_id,
            RolloutState.SUCCEEDED,
            reward=posted,
            exit_code=result.exit_code,
            info=info,
        )
    if posted_reward == "require":
        info["error"] = "the harness posted no reward (rollout.posted_reward=require)"
        return store.transition(
            spec.rollout_id, RolloutState.FAILED, exit_code=result.exit_code, info=info
        )
    return _Unscored(spec, result, calls, info)


def _evaluate_all(evaluate: Evaluate, todo: list[_Unscored], workers: int) -> list[Evaluation]:
    def one(u: _Unscored) -> Evaluation:
        return evaluate(u.spec.task, u.result, u.calls)

    if workers == 1 or len(todo) < 2:
        return [one(u) for u in todo]
    with ThreadPoolExecutor(max_workers=min(workers, len(todo))) as pool:
        return list(pool.map(one, todo))


def _score(store: TraceStore, u: _Unscored, evaluation: Evaluation) -> RolloutRecord:
    info = {**u.info, **evaluation.info, "reward_source": "evaluator"}
    rid, code = u.spec.rollout_id, u.result.exit_code
    if evaluation.reward is None:
        # The evaluator could not judge (a grader that never ran): failed, never a reward of 0.
        info.setdefault("error", "the evaluator could not score this run")
        return store.transition(rid, RolloutState.FAILED, exit_code=code, info=info)
    return store.transition(
        rid, RolloutState.SUCCEEDED, reward=float(evaluation.reward), exit_code=code, info=info
    )
