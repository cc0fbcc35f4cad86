"""Task cleaning: a JSONL of SWE-bench or SWE-smith rows in, the rows every filter keeps out.

In: `python -m harnessrl.curate IN.jsonl OUT.jsonl [key=value ...]` (a `CleanConfig`). Out:
OUT with the kept rows exactly as read, OUT.report.json with each step's in/out counts and dropped
ids (the same table is printed), and optionally a JSONL of dropped rows with step and reason.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harnessrl.cli import command_line, fail
from harnessrl.coding.grade import Grade, GradeConfig, grade
from harnessrl.coding.repo import GitError, git, mirror_of
from harnessrl.coding.tasks import KINDS, CodingTask, RowError, task_from_row
from harnessrl.curate.dedup import (
    contamination,
    cutoff_time,
    near_duplicates,
    read_eval_set,
)
from harnessrl.curate.probe import PassKFilter, Probe, loop_probe, select_passk

PROG = "python -m harnessrl.curate"
STEPS = ("statement", "source", "tests", "license", "decontaminate", "dedup", "gold", "f2p",
         "passk")  # fmt: skip


@dataclass(frozen=True)
class StatementFilter:
    """statement: empty or too-short problem statements."""

    min_chars: int = 40  # characters after stripping whitespace

    def __post_init__(self) -> None:
        if self.min_chars < 0:
            raise ValueError(f"min_chars must be >= 0, got {self.min_chars!r}")


@dataclass(frozen=True)
class SourceFilter:
    """source: where a task's code comes from (SWE-smith branches, container images)."""

    branches: bool = True  # SWE-smith rows: the branch must exist in grade.sandbox.mirrors
    require_image: bool = False  # drop rows that name no image (image or image_name)


@dataclass(frozen=True)
class TestsFilter:
    """tests: rows with no FAIL_TO_PASS test, a test in both lists, or too many tests."""

    max_tests: int = 200  # FAIL_TO_PASS + PASS_TO_PASS together

    def __post_init__(self) -> None:
        if self.max_tests < 1:
            raise ValueError(f"max_tests must be >= 1, got {self.max_tests!r}")


@dataclass(frozen=True)
class LicenseFilter:
    """license: an allow-list of SPDX ids for rows that carry a `license` field."""

    allow: tuple[str, ...] = ()  # e.g. MIT,BSD-3-Clause,Apache-2.0; empty: the step is off
    drop_unlicensed: bool = False  # also drop rows that carry no license field


@dataclass(frozen=True)
class DecontaminateFilter:
    """decontaminate: tasks that overlap an evaluation set, or are newer than a cut-off."""

    eval_set: str = ""  # JSONL of eval rows (instance_id, optional repo), e.g. SWE-bench Verified
    same_repo: bool = False  # drop every task from a repository the eval set uses
    created_after: str = ""  # ISO date: drop rows whose created_at is later (rows without: kept)

    def __post_init__(self) -> None:
        if self.created_after:
            cutoff_time(self.created_after)


@dataclass(frozen=True)
class DedupFilter:
    """dedup: near-duplicate problem statements; the first of each group is kept."""

    threshold: float = 0.8  # Jaccard of word shingles at or above which two are duplicates
    shingle_words: int = 5  # words per shingle

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold!r}")
        if self.shingle_words < 1:
            raise ValueError(f"shingle_words must be >= 1, got {self.shingle_words!r}")


@dataclass(frozen=True)
class CleanConfig:
    """`python -m harnessrl.curate IN.jsonl OUT.jsonl`: which filters run, and how."""

    input: str = ""  # the task rows (JSONL)
    output: str = ""  # the kept rows; OUT.report.json goes beside it
    steps: tuple[str, ...] = STEPS  # filters in the order they run (schema always runs first)
    kind: str = "auto"  # auto | swe-bench | swe-smith: how rows are read
    dropped: str = ""  # also write each dropped row with its step and reason to this JSONL
    workers: int = 4  # tasks graded at once by the gold and f2p steps
    statement: StatementFilter = field(default_factory=StatementFilter)
    source: SourceFilter = field(default_factory=SourceFilter)
    tests: TestsFilter = field(default_factory=TestsFilter)
    license: LicenseFilter = field(default_factory=LicenseFilter)
    decontaminate: DecontaminateFilter = field(default_factory=DecontaminateFilter)
    dedup: DedupFilter = field(default_factory=DedupFilter)
    grade: GradeConfig = field(default_factory=GradeConfig)
    passk: PassKFilter = field(default_factory=PassKFilter)

    def __post_init__(self) -> None:
        unknown = [s for s in self.steps if s not in STEPS]
        if unknown or len(set(self.steps)) != len(self.steps):
            raise ValueError(f"steps must be distinct names from {STEPS}, got {self.steps!r}")
        if self.kind not in ("auto", *KINDS):
            raise ValueError(f"kind must be 'auto' or one of {KINDS}, got {self.kind!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers!r}")
        if self.input and self.output and Path(self.input).resolve() == Path(self.output).resolve():
            raise ValueError(f"output must not be the input file {self.input!r}")


@dataclass(frozen=True)
class Row:
    """One task row: its line, its text (written out unchanged when kept) and the task it reads as."""

    line: int
    text: str
    task: CodingTask


@dataclass(frozen=True)
class Dropped:
    line: int
    text: str
    name: str  # the instance id, or "line N" for a row that does not parse
    step: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        try:
            row: Any = json.loads(self.text)
        except json.JSONDecodeError:
            row = self.text
        return {"line": self.line, "instance_id": self.name, "step": self.step,
                "reason": self.reason, "row": row}  # fmt: skip


@dataclass(frozen=True)
class Step:
    """One step's counts, and each dropped row's instance id (or line N) with the reason."""

    name: str
    rows_in: int
    rows_out: int
    seconds: float
    note: str = ""  # why a listed step had nothing to do
    dropped: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Report:
    input: str
    output: str
    steps: list[Step]
    kept: list[Row]
    dropped: list[Dropped]

    def to_json(self) -> dict[str, Any]:
        return {"input": self.input, "output": self.output, "rows_in": self.steps[0].rows_in,
                "rows_out": len(self.kept), "steps": [asdict(s) for s in self.steps]}  # fmt: skip


TABLE_HEAD = f"{'step':<14}{'in':>7}{'out':>7}{'dropped':>9}{'seconds':>9}  note\n"


def table_row(s: Step) -> str:
    return (f"{s.name:<14}{s.rows_in:>7}{s.rows_out:>7}{len(s.dropped):>9}{s.seconds:>9.1f}  "
            f"{s.note}").rstrip() + "\n"  # fmt: skip


def read_rows(path: Path, kind: str) -> tuple[list[Row], list[Dropped]]:
    """The schema step: every non-blank line read as a task, or dropped with the RowError."""
    if not path.is_file():
        raise ValueError(f"input {str(path)!r} does not exist")
    rows: list[Row] = []
    bad: list[Dropped] = []
    seen: dict[str, int] = {}
    # Lines end at "\n" only: JSON text may hold a raw U+2028 or U+0085, which splitlines() splits.
    for lineno, text in enumerate(path.read_text().split("\n"), start=1):
        text = text.removesuffix("\r")
        if not text.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError as err:
                raise RowError(f"{where}: not valid JSON ({err})") from err
            task = task_from_row(parsed, where=where, kind=kind)
            if task.instance_id in seen:
                raise RowError(f"{where}: instance {task.instance_id!r} already on line "
                               f"{seen[task.instance_id]}")  # fmt: skip
        except RowError as err:
            bad.append(Dropped(lineno, text, f"line {lineno}", "schema", str(err)))
            continue
        seen[task.instance_id] = lineno
        rows.append(Row(lineno, text, task))
    return rows, bad


def check_statement(tasks: list[CodingTask], config: CleanConfig) -> dict[int, str]:
    need = config.statement.min_chars
    out = {}
    for i, task in enumerate(tasks):
        size = len(task.problem_statement.strip())
        if size < need:
            out[i] = "empty problem statement" if size == 0 else (
                f"problem statement has {size} characters, fewer than statement.min_chars={need}"
            )  # fmt: skip
    return out


def _branches(task: CodingTask, mirrors: str, cache: dict[str, set[str] | str]) -> set[str] | str:
    """The branch names of the task's mirror (one ls-remote per repository), or why there are none."""
    if task.repo not in cache:
        try:
            heads = git(".", "ls-remote", "--heads", mirror_of(task, mirrors))
            cache[task.repo] = {ln.split("\t")[1].removeprefix("refs/heads/")
                                for ln in heads.splitlines() if "\t" in ln}  # fmt: skip
        except (ValueError, GitError) as err:
            cache[task.repo] = f"its repository cannot be read: {err}"
    return cache[task.repo]


def check_source(tasks: list[CodingTask], config: CleanConfig) -> dict[int, str]:
    cache: dict[str, set[str] | str] = {}
    out = {}
    for i, task in enumerate(tasks):
        if config.source.require_image and not task.image:
            out[i] = "no image (source.require_image is set)"
        elif config.source.branches and task.kind == "swe-smith":
            heads = _branches(task, config.grade.sandbox.mirrors, cache)
            if isinstance(heads, str) or task.branch not in heads:
                out[i] = heads if isinstance(heads, str) else (
                    f"branch {task.branch!r} is not in the mirror of {task.repo!r}"
                )  # fmt: skip
    return out


def check_tests(tasks: list[CodingTask], config: CleanConfig) -> dict[int, str]:
    most = config.tests.max_tests
    out = {}
    for i, task in enumerate(tasks):
        both = sorted(set(task.fail_to_pass) & set(task.pass_to_pass))
        count = len(set(task.fail_to_pass) | set(task.pass_to_pass))
        if not task.fail_to_pass:
            out[i] = "no FAIL_TO_PASS tests"
        elif both:
            out[i] = f"test {both[0]!r} is in both FAIL_TO_PASS and PASS_TO_PASS"
        elif count > most:
            out[i] = f"{count} tests, more than tests.max_tests={most}"
    return out


def check_license(tasks: list[CodingTask], config: CleanConfig) -> dict[int, str]:
    allow = {a.lower() for a in config.license.allow}
    out = {}
    for i, task in enumerate(tasks):
        spdx = task.meta.get("license")
        if spdx is None:
            if config.license.drop_unlicensed:
                out[i] = "no license field (license.drop_unlicensed is set)"
        elif not isinstance(spdx, str) or spdx.strip().lower() not in allow:
            out[i] = f"license {spdx!r} is not in license.allow"
    return out


def check_decontaminate(tasks: list[CodingTask], config: CleanConfig) -> dict[int, str]:
    c = config.decontaminate
    evals = read_eval_set(c.eval_set) if c.eval_set else None
    cutoff = cutoff_time(c.created_after) if c.created_after else None
    found = {i: contamination(t, evals, same_repo=c.same_repo, cutoff=cutoff)
             for i, t in enumerate(tasks)}  # fmt: skip
    return {i: why for i, why in found.items() if why}


def check_dedup(tasks: list[CodingTask], config: CleanConfig) -> dict[int, str]:
    texts = [t.problem_statement for t in tasks]
    dups = near_duplicates(texts, config.dedup.threshold, config.dedup.shingle_words)
    return {i: f"problem statement near-duplicates {tasks[j].instance_id!r}"
            for i, j in dups.items()}  # fmt: skip


def _grade_all(
    tasks: list[CodingTask], config: CleanConfig, diff: Callable[[CodingTask], str]
) -> list[Grade]:
    with ThreadPoolExecutor(config.workers) as pool:
        return list(pool.map(lambda t: grade(t, diff(t), config.grade), tasks))


def _failing(pairs: tuple[tuple[str, bool], ...]) -> str:
    bad = [t for t, ok in pairs if not ok]
    return ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")


def check_gold(tasks: list[CodingTask], config: CleanConfig) -> dict[int, str]:
    out = {}
    for i, g in enumerate(_grade_all(tasks, config, lambda t: t.patch)):
        if g.resolved:
            continue
        if g.reward is None or not g.applied:
            out[i] = f"gold patch could not be graded: {g.error}"
        elif g.dropped:
            out[i] = f"gold patch edits files the grader drops ({', '.join(g.dropped)})"
        else:
            f2p, p2p = _failing(g.f2p), _failing(g.p2p)
            fails = "; ".join(
                s for s in (f2p and f"FAIL_TO_PASS {f2p}", p2p and f"PASS_TO_PASS {p2p}") if s
            )
            out[i] = f"gold patch does not pass: {fails or f'test command exit {g.exit_code}'}"
    return out


def check_f2p(tasks: list[CodingTask], config: CleanConfig) -> dict[int, str]:
    out = {}
    for i, g in enumerate(_grade_all(tasks, config, lambda t: "")):
        passing = [t for t, ok in g.f2p if ok]
        if g.reward is None:
            out[i] = f"the unfixed base could not be graded: {g.error}"
        elif passing:
            out[i] = f"FAIL_TO_PASS test {passing[0]!r} passes without the fix"
    return out


def _off(name: str, config: CleanConfig) -> str:
    """Why a listed step has nothing to do ("" when it runs)."""
    if name == "license" and not config.license.allow:
        return "off: no license.allow"
    if name == "decontaminate" and not (
        config.decontaminate.eval_set or config.decontaminate.created_after
    ):
        return "off: no decontaminate.eval_set or created_after"
    if name == "passk" and config.passk.k == 0:
        return "off: passk.k=0"
    return ""


CHECKS: dict[str, Callable[[list[CodingTask], CleanConfig], dict[int, str]]] = {
    "statement": check_statement, "source": check_source, "tests": check_tests,
    "license": check_license, "decontaminate": check_decontaminate, "dedup": check_dedup,
    "gold": check_gold, "f2p": check_f2p,
}  # fmt: skip


def clean(
    config: CleanConfig,
    probe: Probe | None = None,
    on_step: Callable[[Step], None] = lambda s: None,
) -> Report:
    """Run the schema step, then `config.steps` in order; write the kept rows and the report.

    `probe` plays the passk step's runs; by default one round of the train loop (`loop_probe`).
    `on_step` sees each step as it ends (a long grading run shows its progress).
    """
    if not config.input or not config.output:
        raise ValueError("clean needs an input and an output path")
    notes = {name: _off(name, config) for name in config.steps}
    probe_dir = Path(config.passk.out_dir or f"{config.output}.passk")
    probe = probe or loop_probe(config.passk, config.input, probe_dir)
    start = time.monotonic()
    rows, dropped = read_rows(Path(config.input), config.kind)
    _check_mirrors([r.task for r in rows], config)
    schema = {d.name: d.reason for d in dropped}
    steps = [Step("schema", len(rows) + len(dropped), len(rows), _since(start), "", schema)]
    on_step(steps[0])
    for name in config.steps:
        start = time.monotonic()
        verdicts: dict[int, str] = {}
        if rows and not notes[name]:
            tasks = [r.task for r in rows]
            if name == "passk":
                verdicts = select_passk(probe(tasks, config.passk.k), tasks, config.passk)
            else:
                verdicts = CHECKS[name](tasks, config)
        gone = [(rows[i], why) for i, why in sorted(verdicts.items())]
        dropped += [Dropped(r.line, r.text, r.task.instance_id, name, why) for r, why in gone]
        steps.append(Step(name, len(rows), len(rows) - len(gone), _since(start), notes[name],
                          {r.task.instance_id: why for r, why in gone}))  # fmt: skip
        on_step(steps[-1])
        rows = [r for i, r in enumerate(rows) if i not in verdicts]
    report = Report(config.input, config.output, steps, rows, dropped)
    _write(report, config)
    return report


def _check_mirrors(tasks: list[CodingTask], config: CleanConfig) -> None:
    """Stop before any step runs if repository-backed rows have nowhere to be checked out from."""
    if config.grade.sandbox.mirrors:
        return
    smith = config.source.branches and "source" in config.steps
    need = [t for t in tasks if t.repo and not t.files and (
        {"gold", "f2p"} & set(config.steps) or (smith and t.kind == "swe-smith"))]  # fmt: skip
    if need:
        raise ValueError(
            f"{len(need)} rows name repositories (e.g. {need[0].repo!r} for "
            f"{need[0].instance_id!r}), which the gold, f2p and source steps check out: set "
            "grade.sandbox.mirrors (a folder of clones or a URL template), or leave those steps out"
        )


def _since(start: float) -> float:
    return round(time.monotonic() - start, 3)


def _write(report: Report, config: CleanConfig) -> None:
    out = Path(config.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(r.text + "\n" for r in report.kept))
    Path(f"{out}.report.json").write_text(json.dumps(report.to_json(), indent=1) + "\n")
    if config.dropped:
        path = Path(config.dropped)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(d.to_json()) + "\n" for d in report.dropped))


def parse_args(argv: Sequence[str]) -> CleanConfig:
    """IN and OUT first (or --input/--output), then any `key=value` of `CleanConfig`."""
    args = list(argv)
    positional: list[str] = []
    while args and len(positional) < 2 and not args[0].startswith("-") and "=" not in args[0]:
        positional.append(args.pop(0))
    named = [f"--{k}={v}" for k, v in zip(("input", "output"), positional, strict=False)]
    config: CleanConfig = command_line(CleanConfig(), [*named, *args], prog=PROG,
                                       doc=__doc__ or "", required=("input", "output"))  # fmt: skip
    return config


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(sys.argv[1:] if argv is None else argv)

    def show(step: Step) -> None:
        sys.stdout.write((TABLE_HEAD if step.name == "schema" else "") + table_row(step))
        sys.stdout.flush()

    try:
        report = clean(config, on_step=show)
    except ValueError as err:
        fail(PROG, err)
    rows_in = report.steps[0].rows_in
    print(f"kept {len(report.kept)} of {rows_in} rows: {config.output} "
          f"(report: {config.output}.report.json)")  # fmt: skip
    return 0
