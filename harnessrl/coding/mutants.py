"""Buggy variants of a function: one-token mutations of its source, judged by running its checks.

In: a module's source, the line its solution starts on, and assert statements over `candidate`.
Out: `Mutation`s, and (in a child process, `python -m harnessrl.coding.mutants`) which mutant each
problem keeps: the first whose checks split into some failing and some passing, under a fixed
budget of executed lines so hangs are rejected the same way on every machine.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import keyword
import signal
import sys
import tokenize
from dataclasses import dataclass
from typing import Any

SWAPS = {
    "flip_comparison": {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "=="},
    "swap_operator": {"+": "-", "-": "+", "+=": "-=", "-=": "+="},
    "swap_boolean": {"and": "or", "or": "and", "True": "False", "False": "True"},
    "swap_min_max": {"min": "max", "max": "min"},
}
LINE_BUDGET = 200_000  # executed lines per check; HumanEval checks need a few thousand
WALL_BACKSTOP_S = 10.0  # only for loops in C that the line budget cannot see


@dataclass(frozen=True)
class Mutation:
    kind: str
    line: int  # 1-based, like tokenize
    col: int
    end_col: int
    replacement: str

    def apply(self, source: str) -> str:
        lines = source.splitlines(keepends=True)
        text = lines[self.line - 1]
        lines[self.line - 1] = text[: self.col] + self.replacement + text[self.end_col :]
        return "".join(lines)


def _binary(prev: tokenize.TokenInfo | None) -> bool:
    """Is a +/- after `prev` a binary operator (not a sign)?"""
    if prev is None:
        return False
    if prev.type == tokenize.NAME:
        return not keyword.iskeyword(prev.string) or prev.string in ("True", "False", "None")
    return prev.type in (tokenize.NUMBER, tokenize.STRING) or prev.string in (")", "]", "}")


def candidates(source: str, first_line: int) -> list[Mutation]:
    """Every one-token mutation at or after `first_line`, in source order."""
    tokens = [
        t
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT)
    ]
    found: list[Mutation] = []
    for i, tok in enumerate(tokens):
        (row, col), (end_row, end_col) = tok.start, tok.end
        if row < first_line or row != end_row:
            continue
        prev = tokens[i - 1] if i else None
        for kind, table in SWAPS.items():
            if tok.string in table and (kind != "swap_operator" or _binary(prev)):
                found.append(Mutation(kind, row, col, end_col, table[tok.string]))
        if tok.type == tokenize.NUMBER and tok.string.isdigit() and int(tok.string) < 1000:
            n = int(tok.string)
            found += [
                Mutation("off_by_one", row, col, end_col, str(m)) for m in (n + 1, n - 1) if m >= 0
            ]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if tok.string == "not" and nxt is not None and nxt.start[0] == row:
            found.append(Mutation("drop_negation", row, col, nxt.start[1], ""))
    return found


def check_asserts(test_source: str) -> list[ast.Assert] | None:
    """The asserts of `check(candidate)` that call it, or None when check is not only asserts."""
    tree = ast.parse(test_source)
    check = next(
        (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None
    )
    if check is None or not all(isinstance(s, ast.Assert) for s in check.body):
        return None
    uses = [
        s
        for s in check.body
        if any(isinstance(n, ast.Name) and n.id == "candidate" for n in ast.walk(s))
    ]
    return uses  # type: ignore[return-value]


class _Budget(BaseException):
    """Raised inside a check that ran too long (BaseException: `except Exception` won't eat it)."""


def _run(code: Any, scope: dict[str, Any]) -> bool | None:
    """True/False: the code ran clean / raised; None: it blew the budget (a hang)."""
    count = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
            if count > LINE_BUDGET:
                raise _Budget
        return tracer

    def alarm(signum: int, frame: Any) -> None:
        raise _Budget

    # Whatever traced before (a coverage run, a debugger) is put back afterwards, as is the
    # alarm handler.
    previous_trace, previous_alarm = sys.gettrace(), signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, WALL_BACKSTOP_S)
    sys.settrace(tracer)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(code, scope)
        return True
    except _Budget:
        return None
    except Exception:
        return False
    finally:
        sys.settrace(previous_trace)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_alarm)


def evaluate(source: str, entry: str, checks: list[str]) -> list[bool | None]:
    """Each check's outcome against `entry` defined by `source` (all False if it won't load)."""
    scope: dict[str, Any] = {"__name__": "candidate_module"}
    try:
        loaded = _run(compile(source, "<candidate>", "exec"), scope)
    except SyntaxError:
        loaded = False
    if not loaded or not callable(scope.get(entry)):
        return [False if loaded is not None else None] * len(checks)
    outcomes: list[bool | None] = []
    for check in checks:
        outcomes.append(
            _run(compile(check, "<check>", "exec"), {**scope, "candidate": scope[entry]})
        )
    return outcomes


def actual_value(source: str, entry: str, call: str) -> str | None:
    """repr of `call` under `source` (None if it fails, hangs or is too long to quote)."""
    scope: dict[str, Any] = {"__name__": "candidate_module"}
    if not _run(compile(source, "<candidate>", "exec"), scope):
        return None
    scope["candidate"] = scope[entry]
    if not _run(compile(f"__value__ = repr({call})", "<call>", "exec"), scope):
        return None
    value = scope["__value__"]
    return value if len(value) <= 120 else None


def choose(job: dict[str, Any]) -> dict[str, Any] | None:
    """The first mutant of `job` whose checks split; the original must pass every check."""
    entry, checks = job["entry"], job["checks"]
    if evaluate(job["original"], entry, checks) != [True] * len(checks):
        return None
    for index, mutant in enumerate(job["mutants"]):
        outcomes = evaluate(mutant, entry, checks)
        if None in outcomes or all(outcomes) or not any(outcomes):
            continue
        first_fail = outcomes.index(False)
        call = job["calls"][first_fail]
        actual = actual_value(mutant, entry, call) if call else None
        return {"index": index, "outcomes": outcomes, "actual": actual}
    return None


def main() -> None:
    """Child protocol: a JSON list of jobs on stdin, a JSON list of choices on stdout."""
    sys.setrecursionlimit(800)  # below pytest's headroom, so what passes here passes there
    jobs = json.load(sys.stdin)
    json.dump([choose(job) for job in jobs], sys.stdout)


if __name__ == "__main__":
    main()
