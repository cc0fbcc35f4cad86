"""Evaluators: a finished run (its final output, the task, its calls) → a reward.

In: a `Task`, the launcher's `RunResult` and the run's `CallRecord`s. Out: an `Evaluation`
(reward and details for the rollout record). Programmatic checks for answer-style tasks, or a
user's own reward function named as `module:function`.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from harnessrl.rollout.tasks import RunResult, Task
from harnessrl.traces.schema import CallRecord, RolloutState

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Evaluation:
    """A run's reward; None means the evaluator could not judge (the run is marked failed)."""

    reward: float | None
    info: dict[str, Any] = field(default_factory=dict)


Evaluate = Callable[[Task, RunResult, Sequence[CallRecord]], Evaluation]


def _need_answer(task: Task, evaluator: str) -> str:
    if task.answer is None:
        raise ValueError(
            f"evaluator {evaluator!r} needs task.answer, but task {task.task_id!r} has none; "
            "add an 'answer' to the task file or pick another evaluator"
        )
    return task.answer


def _check_finished(result: RunResult) -> None:
    if result.state != RolloutState.SUCCEEDED:
        # Failed and timed-out runs are excluded from training, never scored as reward 0.
        raise ValueError(
            f"run {result.rollout_id!r} is {result.state.value}; only succeeded runs are evaluated"
        )


def last_number(text: str) -> str | None:
    """The last number in `text` in canonical form ("24", "-3", "2.5"), or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    if not found:
        return None
    value = float(found[-1])
    return str(int(value)) if value.is_integer() else repr(value)


def exact_number(task: Task, result: RunResult, calls: Sequence[CallRecord] = ()) -> Evaluation:
    """1.0 when the last number of the output equals the answer, else 0.0."""
    _check_finished(result)
    want = last_number(_need_answer(task, "exact_number"))
    if want is None:
        raise ValueError(f"task {task.task_id!r}: answer {task.answer!r} holds no number")
    got = last_number(result.output)
    bare = result.output.strip().rstrip(".") == want
    return Evaluation(
        reward=float(got == want),
        info={"parsed": got, "expected": want, "bare": bare, "calls": len(calls)},
    )


def exact_match(task: Task, result: RunResult, calls: Sequence[CallRecord] = ()) -> Evaluation:
    """1.0 when the whole output equals the answer (whitespace and case ignored), else 0.0."""
    _check_finished(result)
    want = " ".join(_need_answer(task, "exact_match").split()).lower()
    got = " ".join(result.output.split()).lower()
    return Evaluation(reward=float(got == want), info={"expected": want, "calls": len(calls)})


def contains(task: Task, result: RunResult, calls: Sequence[CallRecord] = ()) -> Evaluation:
    """1.0 when the answer appears in the output (case ignored), else 0.0."""
    _check_finished(result)
    want = _need_answer(task, "contains").strip().lower()
    return Evaluation(
        reward=float(want in result.output.lower()),
        info={"expected": want, "calls": len(calls)},
    )


def exit_code(task: Task, result: RunResult, calls: Sequence[CallRecord] = ()) -> Evaluation:
    """The harness judges itself: 1.0 when the run exited 0 (e.g. its own tests passed)."""
    return Evaluation(reward=float(result.exit_code == 0), info={"exit_code": result.exit_code})


EVALUATORS: dict[str, Evaluate] = {
    "exact_number": exact_number,
    "exact_match": exact_match,
    "contains": contains,
    "exit_code": exit_code,
}


def get_evaluator(name: str) -> Evaluate:
    """A built-in evaluator by name, or a user's reward function as `module:function`."""
    if ":" in name:
        return _import_evaluator(name)
    try:
        return EVALUATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown rollout.evaluator {name!r}; choose one of {sorted(EVALUATORS)} "
            "or name your own function as module:function"
        ) from None


def _import_evaluator(spec: str) -> Evaluate:
    module_name, _, attr = spec.partition(":")
    key = f"rollout.evaluator={spec!r}"
    if not module_name or not attr:
        raise ValueError(f"{key}: write it as module:function, e.g. my_rewards:score")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"{key}: cannot import module {module_name!r} ({err}); put its folder on PYTHONPATH "
            "or start the trainer from that folder"
        ) from err
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"{key}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"{key}: {attr!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind(None, None, None)
    except TypeError as err:
        raise ValueError(f"{key}: {attr} must take (task, result, calls): {err}") from err
    except ValueError:
        pass  # no signature to check (some builtins); a wrong one fails at the first call

    def evaluate(task: Task, result: RunResult, calls: Sequence[CallRecord]) -> Evaluation:
        return _as_evaluation(spec, fn(task, result, calls))

    return evaluate


def _as_evaluation(spec: str, value: Any) -> Evaluation:
    """A user function may return an `Evaluation` or a bare number (a bool counts as 0 or 1)."""
    evaluation = value if isinstance(value, Evaluation) else None
    reward = evaluation.reward if evaluation is not None else value
    if not isinstance(reward, int | float):
        raise TypeError(
            f"rollout.evaluator={spec!r} returned {type(value).__name__} {value!r}; "
            "return a number or an Evaluation(reward, info)"
        )
    if not math.isfinite(reward):
        raise ValueError(f"rollout.evaluator={spec!r} returned a non-finite reward {reward!r}")
    return evaluation if evaluation is not None else Evaluation(float(reward))
