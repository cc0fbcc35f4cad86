"""A user's own reward functions, named as `rollout.evaluator=module:function` in the tests."""

from __future__ import annotations

from collections.abc import Sequence

from harnessrl.rollout.evaluators import Evaluation
from harnessrl.rollout.tasks import RunResult, Task
from harnessrl.traces.schema import CallRecord

NOT_A_FUNCTION = 3


def per_call(task: Task, result: RunResult, calls: Sequence[CallRecord]) -> float:
    """0.25 per recorded model call: a number is enough."""
    return 0.25 * len(calls)


def answer_in_output(task: Task, result: RunResult, calls: Sequence[CallRecord]) -> Evaluation:
    found = task.answer is not None and task.answer in result.output
    return Evaluation(float(found), {"checked": task.answer})


def too_few_arguments(task: Task) -> float:
    return 0.0


def returns_text(task: Task, result: RunResult, calls: Sequence[CallRecord]) -> str:
    return "high"


def returns_nan(task: Task, result: RunResult, calls: Sequence[CallRecord]) -> float:
    return float("nan")
