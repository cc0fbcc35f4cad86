from __future__ import annotations

import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from taskkit import config, needs_bwrap

from harnessrl.coding.grade import GradeConfig, grade
from harnessrl.coding.mutants import candidates, choose, evaluate
from harnessrl.coding.taskset import SHIPPED, load_shipped, main

SOURCE = "def f(xs, n):\n    total = -1\n    for x in xs[1:]:\n        if x > n and not x == 0:\n            total += x - 1\n    return min(total, 10)\n"


def test_candidates_cover_each_kind_and_leave_signs_alone():
    found = {(m.kind, m.replacement) for m in candidates(SOURCE, 2)}
    assert ("flip_comparison", ">=") in found and ("flip_comparison", "!=") in found
    assert ("swap_boolean", "or") in found and ("swap_min_max", "max") in found
    assert ("swap_operator", "-=") in found and ("swap_operator", "+") in found  # x - 1
    assert ("drop_negation", "") in found
    assert ("off_by_one", "2") in found and ("off_by_one", "0") in found
    signs = [m for m in candidates(SOURCE, 2) if m.kind == "swap_operator" and m.line == 2]
    assert signs == []  # the unary minus of -1 is not an operator to swap
    assert all(m.line >= 2 for m in candidates(SOURCE, 2))
    flipped = next(m for m in candidates(SOURCE, 2) if m.kind == "drop_negation").apply(SOURCE)
    assert "if x > n and x == 0:" in flipped


def test_evaluate_rejects_hangs_by_a_line_budget_not_by_time():
    looping = "def f(n):\n    while n:\n        n += 1\n    return n\n"
    start = time.monotonic()
    assert evaluate(looping, "f", ["assert candidate(1) == 0", "assert candidate(0) == 0"]) == [
        None,
        True,
    ]
    assert time.monotonic() - start < 30
    assert evaluate("def f(:\n", "f", ["assert candidate(1)"]) == [False]


def test_evaluate_puts_back_the_tracer_and_alarm_handler_it_found() -> None:
    """A coverage run or a debugger keeps tracing after a check (a reset to None would stop it)."""

    def outer(frame: object, event: str, arg: object) -> None:
        return None

    def handler(signum: int, frame: object) -> None:
        return None

    previous_trace, previous_alarm = sys.gettrace(), signal.signal(signal.SIGALRM, handler)
    sys.settrace(outer)
    try:
        assert evaluate("def f(n):\n    return n\n", "f", ["assert candidate(1) == 1"]) == [True]
        assert sys.gettrace() is outer and signal.getsignal(signal.SIGALRM) is handler
    finally:
        sys.settrace(previous_trace)
        signal.signal(signal.SIGALRM, previous_alarm)


def test_choose_keeps_the_first_mutant_whose_checks_split():
    job = {
        "entry": "f",
        "original": "def f(n):\n    return n + 1\n",
        "checks": [
            "assert candidate(1) == 2",
            "assert candidate(0) == 1",
            "assert candidate(-1) == 0",
        ],
        "calls": ["candidate(1)", "candidate(0)", "candidate(-1)"],
        "mutants": [
            "def f(n):\n    return n - 1\n",  # fails every check: no PASS_TO_PASS, skipped
            "def f(n):\n    return abs(n) + 1\n",  # fails only f(-1)
        ],
    }
    assert choose(job) == {"index": 1, "outcomes": [True, True, False], "actual": "2"}
    assert choose({**job, "original": "def f(n):\n    return n\n"}) is None  # original must pass


def test_regenerating_gives_the_shipped_file_byte_for_byte(tmp_path, capsys):
    out = tmp_path / "tasks.jsonl"
    main(["--out", str(out)])
    assert out.read_bytes() == SHIPPED.read_bytes()
    assert "wrote 48 tasks" in capsys.readouterr().out


def test_shipped_tasks_have_hidden_failing_tests_and_visible_passing_ones():
    tasks = load_shipped()
    assert len(tasks) >= 40 and len({t.instance_id for t in tasks}) == len(tasks)
    assert len({t.meta["mutation"] for t in tasks}) >= 5
    for t in tasks:
        files = dict(t.files)
        module = next(p for p in files if not p.startswith("test_"))
        tests = f"test_{module}"
        assert t.fail_to_pass and t.pass_to_pass and t.kind == "inline"
        for test_id in t.fail_to_pass:  # hidden until the test patch
            name = test_id.split("::")[1]
            assert f"def {name}()" not in files[tests] and f"+def {name}()" in t.test_patch
        for test_id in t.pass_to_pass:
            assert f"def {test_id.split('::')[1]}()" in files[tests]
        assert t.patch.startswith(f"diff --git a/{module} b/{module}")
        assert "For example" in t.problem_statement and t.meta["license"] == "MIT"


@needs_bwrap
def test_every_shipped_task_grades_gold_1_and_empty_0(tmp_path):
    tasks = load_shipped()
    # The shipped tests need no pytest plugins; not loading the installed ones halves the time.
    cfg = GradeConfig(sandbox=config(tmp_path), plugin_autoload=False)
    jobs = [(t, diff) for t in tasks for diff in (t.patch, "")]
    start = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        grades = list(pool.map(lambda job: grade(job[0], job[1], cfg), jobs))
    elapsed = time.monotonic() - start
    wrong = [
        (t.instance_id, "gold" if diff else "empty", g.reward, g.output[-500:])
        for (t, diff), g in zip(jobs, grades, strict=True)
        if g.reward != (1.0 if diff else 0.0)
    ]
    assert wrong == []
    # Empty patches fail exactly FAIL_TO_PASS and keep PASS_TO_PASS: the lists are what they say.
    for (t, diff), g in zip(jobs, grades, strict=True):
        if not diff:
            assert not any(ok for _, ok in g.f2p) and all(ok for _, ok in g.p2p), t.instance_id
    print(f"graded {len(jobs)} in {elapsed:.1f} s")
