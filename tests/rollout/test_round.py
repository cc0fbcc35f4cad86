"""Rollout rounds: records created, runs finished with rewards, failures excluded and counted."""

from __future__ import annotations

from pathlib import Path

import pytest

from harnessrl.rollout.evaluators import get_evaluator
from harnessrl.rollout.round import plan_round, run_round, sample_tasks
from harnessrl.rollout.tasks import RunResult, RunSpec, Task
from harnessrl.traces.schema import RolloutState
from harnessrl.traces.sqlite import SQLiteTraceStore

TASKS = [Task(f"t{i}", f"What is {i}+1?", str(i + 1)) for i in range(4)]


class ScriptedLauncher:
    """Answers each run from a table: rollout id → (state, output)."""

    def __init__(self, outcomes: dict[str, tuple[RolloutState, str]]) -> None:
        self.outcomes = outcomes
        self.seen: list[RunSpec] = []

    def run(self, specs: list[RunSpec]) -> list[RunResult]:
        self.seen += specs
        out = []
        for s in specs:
            state, text = self.outcomes.get(s.rollout_id, (RolloutState.SUCCEEDED, ""))
            code = (
                0
                if state == RolloutState.SUCCEEDED
                else (None if state == RolloutState.TIMED_OUT else 1)
            )
            out.append(RunResult(s.rollout_id, state, code, text, "err", 0.5, text))
        return out


def _specs() -> list[RunSpec]:
    return plan_round(
        TASKS[:2],
        prefix="s0",
        runs_per_task=3,
        base_url=lambda rid: f"http://sidecar/rollouts/{rid}/v1",
        timeout_s=10.0,
        attempt=2,
    )


def test_plan_round_groups_runs_by_task() -> None:
    specs = _specs()
    assert [s.rollout_id for s in specs] == [f"s0-g{g}-r{r}" for g in range(2) for r in range(3)]
    assert [s.group_id for s in specs] == ["s0-g0"] * 3 + ["s0-g1"] * 3
    assert specs[4].task == TASKS[1] and specs[4].attempt == 2
    assert specs[0].base_url == "http://sidecar/rollouts/s0-g0-r0/v1"


def test_run_round_scores_succeeded_runs_and_marks_failures(tmp_path: Path) -> None:
    store = SQLiteTraceStore(str(tmp_path / "t.db"))
    launcher = ScriptedLauncher(
        {
            "s0-g0-r0": (RolloutState.SUCCEEDED, "1"),  # t0's answer is "1"
            "s0-g0-r1": (RolloutState.SUCCEEDED, "0 + 1 = 1"),
            "s0-g0-r2": (RolloutState.FAILED, ""),
            "s0-g1-r0": (RolloutState.TIMED_OUT, ""),
            "s0-g1-r1": (RolloutState.SUCCEEDED, "3"),
            "s0-g1-r2": (RolloutState.SUCCEEDED, "2"),
        }
    )
    result = run_round(_specs(), launcher, store, get_evaluator("exact_number"))
    assert result.rewards == {"s0-g0-r0": 1.0, "s0-g0-r1": 1.0, "s0-g1-r1": 0.0, "s0-g1-r2": 1.0}
    assert result.failed == 2 and result.timed_out == 1
    assert result.reward_mean() == 0.75
    assert result.reward_mean(failed_as=0.0) == 0.5
    assert result.pass_rate == 0.5
    assert result.group_ids == ["s0-g0", "s0-g1"]
    records = {r.rollout_id: r for g in result.group_ids for r in store.rollouts(g)}
    assert records["s0-g0-r2"].state == RolloutState.FAILED and records["s0-g0-r2"].reward is None
    assert records["s0-g1-r0"].state == RolloutState.TIMED_OUT
    assert records["s0-g0-r1"].reward == 1.0 and records["s0-g0-r1"].info["parsed"] == "1"
    assert records["s0-g0-r1"].info["stderr_tail"] == "err" and records["s0-g1-r1"].attempt == 2
    store.close()


def test_a_harness_that_reported_its_own_state_keeps_it(tmp_path: Path) -> None:
    store = SQLiteTraceStore(str(tmp_path / "t.db"))
    specs = _specs()[:1]

    class SelfReporting(ScriptedLauncher):
        def run(self, specs: list[RunSpec]) -> list[RunResult]:
            # What the sidecar's /finish endpoint does when the harness reports a failure itself.
            store.transition(specs[0].rollout_id, RolloutState.RUNNING)
            store.transition(specs[0].rollout_id, RolloutState.FAILED)
            return super().run(specs)

    result = run_round(specs, SelfReporting({}), store, get_evaluator("exact_number"))
    assert result.rewards == {}
    assert store.rollout(specs[0].rollout_id).state == RolloutState.FAILED
    store.close()


def test_sample_tasks_is_deterministic_per_step() -> None:
    assert sample_tasks(TASKS, 2, seed=0, step=5) == sample_tasks(TASKS, 2, seed=0, step=5)
    picks = {tuple(t.task_id for t in sample_tasks(TASKS, 2, seed=0, step=s)) for s in range(20)}
    assert len(picks) > 1
    with pytest.raises(ValueError, match="tasks_per_step=5 exceeds the 4 train tasks"):
        sample_tasks(TASKS, 5, seed=0, step=0)
