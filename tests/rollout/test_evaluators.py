"""Evaluators: exact-number, exact-match, contains, exit-code, a user's module:function; failed
runs are never scored."""

from __future__ import annotations

from pathlib import Path

import pytest

from harnessrl.rollout.evaluators import Evaluation, get_evaluator, last_number
from harnessrl.rollout.tasks import RunResult, Task
from harnessrl.traces.schema import RolloutState

TASK = Task(task_id="add-5-19", prompt="What is 5+19?", answer="24")
USER = "tests.rollout.user_rewards"  # a real module of reward functions, imported by name
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The project root on sys.path, as it is for `python -m harnessrl.train` started there."""
    monkeypatch.syspath_prepend(str(ROOT))


def _result(output: str, state: RolloutState = RolloutState.SUCCEEDED, code: int = 0) -> RunResult:
    return RunResult("r0", state, code, output + "\n", "", 0.1, output)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("24", "24"),
        ("5 + 19 = 24", "24"),
        ("The answer is 24.", "24"),
        ("-3", "-3"),
        ("1,024", "1024"),
        ("2.50", "2.5"),
        ("24.0", "24"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_last_number(text: str, want: str | None) -> None:
    assert last_number(text) == want


def test_exact_number_scores_the_last_number() -> None:
    ev = get_evaluator("exact_number")
    assert ev(TASK, _result("5 + 19 = 24"), ()).reward == 1.0
    assert ev(TASK, _result("24 is not 25"), ()).reward == 0.0
    assert ev(TASK, _result("I don't know"), ()).reward == 0.0
    out = ev(TASK, _result("24"), ())
    assert out.info["bare"] is True and out.info["parsed"] == "24"
    assert ev(TASK, _result("5+19=24"), ()).info["bare"] is False


def test_exact_match_and_contains() -> None:
    task = Task(task_id="t", prompt="Capital of France?", answer="Paris")
    assert get_evaluator("exact_match")(task, _result("  paris "), ()).reward == 1.0
    assert get_evaluator("exact_match")(task, _result("It is Paris"), ()).reward == 0.0
    assert get_evaluator("contains")(task, _result("It is Paris."), ()).reward == 1.0
    assert get_evaluator("contains")(task, _result("Lyon"), ()).reward == 0.0


def test_exit_code_evaluator() -> None:
    ev = get_evaluator("exit_code")
    assert ev(TASK, _result("", code=0), ()).reward == 1.0
    assert ev(TASK, _result("", RolloutState.FAILED, code=1), ()).reward == 0.0


def test_failed_or_timed_out_runs_are_not_scored() -> None:
    for state in (RolloutState.FAILED, RolloutState.TIMED_OUT):
        with pytest.raises(ValueError, match=state.value):
            get_evaluator("exact_number")(TASK, _result("24", state), ())


def test_bad_evaluator_inputs_are_named() -> None:
    with pytest.raises(ValueError, match=r"unknown rollout\.evaluator 'nope'.*module:function"):
        get_evaluator("nope")
    no_answer = Task(task_id="t", prompt="p")
    with pytest.raises(ValueError, match=r"needs task\.answer"):
        get_evaluator("exact_number")(no_answer, _result("1"), ())
    with pytest.raises(ValueError, match="holds no number"):
        get_evaluator("exact_number")(Task("t", "p", answer="many"), _result("1"), ())


def test_a_user_function_returning_a_number_is_an_evaluator(importable: None) -> None:
    ev = get_evaluator(f"{USER}:per_call")
    out = ev(TASK, _result("anything"), ["call-1", "call-2"])  # type: ignore[list-item]
    assert out == Evaluation(0.5)


def test_a_user_function_returning_an_evaluation_keeps_its_info(importable: None) -> None:
    ev = get_evaluator(f"{USER}:answer_in_output")
    assert ev(TASK, _result("it is 24"), ()) == Evaluation(1.0, {"checked": "24"})
    assert ev(TASK, _result("it is 25"), ()).reward == 0.0


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("no_such_module_xyz:score", r"cannot import module 'no_such_module_xyz'"),
        (f"{USER}:missing", rf"module '{USER}' has no attribute 'missing'"),
        (f"{USER}:NOT_A_FUNCTION", r"'NOT_A_FUNCTION' is a int, not a function"),
        (f"{USER}:too_few_arguments", r"too_few_arguments must take \(task, result, calls\)"),
        (f"{USER}:", r"write it as module:function"),
        (":score", r"write it as module:function"),
    ],
)
def test_a_bad_user_evaluator_is_named_before_it_runs(
    importable: None, spec: str, why: str
) -> None:
    with pytest.raises(ValueError, match=rf"rollout\.evaluator='{spec}': {why}"):
        get_evaluator(spec)


def test_a_user_function_returning_no_number_is_a_named_error(importable: None) -> None:
    with pytest.raises(TypeError, match=r"returned str 'high'; return a number or an Evaluation"):
        get_evaluator(f"{USER}:returns_text")(TASK, _result("x"), ())
    with pytest.raises(ValueError, match="non-finite reward nan"):
        get_evaluator(f"{USER}:returns_nan")(TASK, _result("x"), ())
