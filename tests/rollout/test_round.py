"""Rollout rounds: records created, runs finished with rewards, failures excluded and counted."""

from __future__ import annotations

from pathlib import Path

import pytest

from harnessrl.rollout.evaluators import Evaluation, get_evaluator
from harnessrl.rollout.round import RoundResult, plan_round, run_round, sample_tasks
from harnessrl.rollout.tasks import RunResult, RunSpec, Task
from harnessrl.traces.schema import RolloutRecord, RolloutState
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


class PostingLauncher(ScriptedLauncher):
    """Each run in `posts` posts that reward while it runs (what the sidecar's /reward does)."""

    def __init__(
        self,
        store: SQLiteTraceStore,
        posts: dict[str, float],
        outcomes: dict[str, tuple[RolloutState, str]],
    ) -> None:
        super().__init__(outcomes)
        self.store = store
        self.posts = posts

    def run(self, specs: list[RunSpec]) -> list[RunResult]:
        for s in specs:
            if s.rollout_id in self.posts:
                self.store.set_reward(s.rollout_id, self.posts[s.rollout_id])
        return super().run(specs)


class CountingEvaluator:
    def __init__(self) -> None:
        self.scored: list[str] = []

    def __call__(self, task: Task, result: RunResult, calls: object) -> Evaluation:
        self.scored.append(result.rollout_id)
        return Evaluation(0.125, {"by": "evaluator"})


def _posting_round(
    tmp_path: Path, policy: str
) -> tuple[dict[str, RolloutRecord], CountingEvaluator, RoundResult]:
    store = SQLiteTraceStore(str(tmp_path / f"{policy}.db"))
    posts = {"s0-g0-r0": 0.9, "s0-g0-r2": 0.7}  # r2 then fails: its post must not count
    launcher = PostingLauncher(store, posts, outcomes={"s0-g0-r2": (RolloutState.FAILED, "")})
    evaluator = CountingEvaluator()
    result = run_round(_specs()[:3], launcher, store, evaluator, posted_reward=policy)
    records = {r.rollout_id: r for r in store.rollouts("s0-g0")}
    store.close()
    return records, evaluator, result


def test_a_posted_reward_stands_and_the_evaluator_scores_the_others(tmp_path: Path) -> None:
    records, evaluator, result = _posting_round(tmp_path, "keep")
    assert evaluator.scored == ["s0-g0-r1"]  # r0 posted, r2 failed
    assert records["s0-g0-r0"].reward == 0.9
    assert records["s0-g0-r0"].info["reward_source"] == "posted"
    assert records["s0-g0-r0"].info["posted_reward"] == 0.9
    assert records["s0-g0-r1"].reward == 0.125
    assert records["s0-g0-r1"].info["reward_source"] == "evaluator"
    assert result.rewards == {"s0-g0-r0": 0.9, "s0-g0-r1": 0.125}


def test_a_failed_run_is_never_scored_even_by_its_own_post(tmp_path: Path) -> None:
    for policy in ("keep", "ignore", "require"):
        records, _, result = _posting_round(tmp_path, policy)
        failed = records["s0-g0-r2"]
        assert failed.state == RolloutState.FAILED and failed.reward is None
        assert failed.info["posted_reward"] == 0.7 and "reward_source" not in failed.info
        assert "s0-g0-r2" not in result.rewards


def test_ignore_lets_the_evaluator_score_every_run(tmp_path: Path) -> None:
    records, evaluator, _ = _posting_round(tmp_path, "ignore")
    assert evaluator.scored == ["s0-g0-r0", "s0-g0-r1"]
    assert records["s0-g0-r0"].reward == 0.125
    assert records["s0-g0-r0"].info["reward_source"] == "evaluator"
    assert records["s0-g0-r0"].info["posted_reward"] == 0.9  # kept for inspection only


def test_require_fails_a_run_that_posted_no_reward(tmp_path: Path) -> None:
    records, evaluator, result = _posting_round(tmp_path, "require")
    assert evaluator.scored == []
    assert records["s0-g0-r0"].reward == 0.9 and records["s0-g0-r0"].state == "succeeded"
    silent = records["s0-g0-r1"]
    assert silent.state == RolloutState.FAILED and silent.reward is None
    assert "posted no reward" in silent.info["error"] and silent.exit_code == 0
    assert result.failed == 2 and result.rewards == {"s0-g0-r0": 0.9}


def test_unknown_posted_reward_policy_is_named(tmp_path: Path) -> None:
    store = SQLiteTraceStore(str(tmp_path / "t.db"))
    with pytest.raises(ValueError, match=r"posted_reward must be one of .* got 'sometimes'"):
        run_round(_specs(), ScriptedLauncher({}), store, CountingEvaluator(), "sometimes")
    assert store.rollouts() == []  # refused before any record was created
    store.close()


def test_plan_round_hands_each_run_its_own_reward_credential() -> None:
    specs = plan_round(
        TASKS[:1],
        prefix="s3",
        runs_per_task=2,
        base_url=lambda rid: f"http://sidecar/rollouts/{rid}/v1",
        timeout_s=5.0,
        reward=lambda rid: (f"http://sidecar/rollouts/{rid}/reward", f"token-{rid}"),
    )
    assert [(s.reward_url, s.reward_token) for s in specs] == [
        ("http://sidecar/rollouts/s3-g0-r0/reward", "token-s3-g0-r0"),
        ("http://sidecar/rollouts/s3-g0-r1/reward", "token-s3-g0-r1"),
    ]
    assert "token-" not in repr(specs[0])  # a credential stays out of logs and tracebacks
    assert _specs()[0].reward_url == "" and _specs()[0].reward_token == ""
