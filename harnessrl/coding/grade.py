"""Grading we control: the diff taken by us, applied in a fresh sandbox, tests judged by exit code.

In: a task and a diff (or the agent's sandbox, whose diff we take). Out: a `Grade`. The grader never
sees the agent's sandbox beyond that diff: it checks the task out again, drops every change to
tests and test configuration, applies the test patch over the rest and runs FAIL_TO_PASS and
PASS_TO_PASS in one test command; a test passes when the command exits 0 and its JUnit report,
written outside the repository, lists it as passed (never skipped), so printed lines mean nothing.
"""

from __future__ import annotations

import re
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field, replace
from pathlib import Path

from harnessrl.coding.patches import guard_for, patch_paths, split_diff
from harnessrl.coding.repo import GitError, apply_patch, git
from harnessrl.coding.sandbox import Sandbox, SandboxConfig, SandboxError, prepare
from harnessrl.coding.tasks import CodingTask

# Added source lines that reach into the test runner from the code under test (the run is in one
# process, so code could rewrite its own verdict). A speed bump for the plain forms, configurable:
# clear it for repositories whose source is a pytest plugin or pytest itself.
FORBIDDEN = (r"\b_pytest\b", r"^\s*(?:import|from)\s+pytest\b", r"\bpytest\.(?:skip|xfail|exit)\b")


@dataclass(frozen=True)
class GradeConfig:
    """How a diff is judged."""

    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    test_timeout_s: float = 300.0  # the one test command; past it, every test counts as failed
    partial_credit: bool = False  # reward = share of FAIL_TO_PASS passing (when PASS_TO_PASS hold)
    forbidden: tuple[str, ...] = FORBIDDEN  # an added line matching one zeroes the reward
    # `python -m pytest` semantics (the repo root is importable); -s: no user site, -B: no .pyc
    python_flags: tuple[str, ...] = ("-s", "-B")
    pytest_args: tuple[str, ...] = ()
    # Installed pytest plugins load as usual; off saves ~0.2 s per grade where tests need none
    # (the shipped set). Either way the agent cannot add one: the environment is read-only inside.
    plugin_autoload: bool = True

    def __post_init__(self) -> None:
        if not self.test_timeout_s > 0:
            raise ValueError(f"test_timeout_s must be > 0, got {self.test_timeout_s!r}")
        for pattern in self.forbidden:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"forbidden pattern {pattern!r} is not a regex: {err}") from err


@dataclass(frozen=True)
class Grade:
    """The verdict. `reward` None means the grader could not judge (never train on it as 0)."""

    reward: float | None
    resolved: bool
    f2p: tuple[tuple[str, bool], ...]
    p2p: tuple[tuple[str, bool], ...]
    guards: tuple[str, ...]  # guard names tripped: edited_tests, runner_config, bytecode, ...
    dropped: tuple[str, ...]  # paths removed from the diff before it was applied
    applied: bool
    timed_out: bool
    exit_code: int | None
    error: str
    not_isolated: tuple[str, ...]
    duration_s: float
    diff: str  # the diff that was graded (after the guards)
    output: str  # the test command's output, for people


@dataclass(frozen=True)
class Screened:
    diff: str
    dropped: tuple[str, ...]
    guards: tuple[str, ...]


def screen(diff: str, test_patch: str, forbidden: tuple[str, ...] = FORBIDDEN) -> Screened:
    """Drop each file section a guard protects; flag added lines that match `forbidden`."""
    protected = patch_paths(test_patch)
    kept: list[str] = []
    dropped: list[str] = []
    guards: set[str] = set()
    for section in split_diff(diff):
        trips = {g for p in section.paths if (g := guard_for(p, protected))}
        if trips:
            dropped += section.paths
            guards |= trips
        else:
            kept.append(section.text)
    added = [
        ln[1:]
        for s in kept
        for ln in s.splitlines()
        if ln.startswith("+") and not ln.startswith("+++")
    ]
    if any(re.search(pattern, line) for pattern in forbidden for line in added):
        guards.add("forbidden_code")
    return Screened("".join(kept), tuple(dict.fromkeys(dropped)), tuple(sorted(guards)))


def diff_of(sandbox: Sandbox) -> str:
    """The agent's changes (committed, staged, unstaged, untracked) against the base.

    Read with our own copy of the git dir and a throwaway index, so nothing the agent put in its
    .git (config, hooks, rewritten refs) runs or counts; its work tree is only read as files.
    """
    with tempfile.TemporaryDirectory(dir=sandbox.dir) as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        where = ["--git-dir", str(sandbox.base_git), "--work-tree", str(sandbox.workdir)]
        git(sandbox.dir, *where, "read-tree", sandbox.base_commit, env=env)
        git(sandbox.dir, *where, "add", "-A", env=env)
        return git(
            sandbox.dir, *where, "diff", "--cached", "--binary", "--full-index", "--no-renames",
            "--no-ext-diff", "--no-textconv", sandbox.base_commit, env=env,
        )  # fmt: skip


def junit_key(nodeid: str) -> tuple[str, str]:
    """(classname, name) pytest's JUnit writer gives a node id (its mangle_test_address)."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def junit_passed(report: Path) -> dict[tuple[str, str], bool]:
    """Each test case in a JUnit report: passed (no failure, error or skip) or not."""
    try:
        root = ET.parse(report).getroot()
    except (OSError, ET.ParseError):
        return {}
    seen: dict[tuple[str, str], bool] = {}
    for case in root.iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        ok = not any(child.tag in ("failure", "error", "skipped") for child in case)
        seen[key] = seen.get(key, True) and ok
    return seen


@dataclass(frozen=True)
class TestRun:
    passed: dict[str, bool]
    exit_code: int | None
    timed_out: bool
    output: str


def run_tests(sandbox: Sandbox, ids: tuple[str, ...], config: GradeConfig) -> TestRun:
    """One pytest command over `ids`, no network, its JUnit report outside the repository."""
    report_dir = sandbox.dir / "report"
    report_dir.mkdir(exist_ok=True)
    report = report_dir / "junit.xml"
    argv = [
        sandbox.config.interpreter, *config.python_flags, "-m", "pytest", "-q",
        "-p", "no:cacheprovider", f"--junitxml={report}", "-o", "junit_family=xunit2",
        *config.pytest_args, "--", *ids,
    ]  # fmt: skip
    env = {} if config.plugin_autoload else {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    done = sandbox.run(argv, timeout_s=config.test_timeout_s, writable=(report_dir,), env=env)
    cases = {} if done.timed_out else junit_passed(report)
    passed = {t: cases.get(junit_key(t), False) for t in ids}
    return TestRun(passed, done.exit_code, done.timed_out, (done.stdout + done.stderr)[-8000:])


def _verdict(task: CodingTask, run: TestRun, config: GradeConfig, zeroed: bool) -> float:
    """1 when the command exited 0 and reported every test passed; partial credit if asked."""
    if zeroed or run.timed_out:
        return 0.0
    if run.exit_code == 0 and all(run.passed.values()):
        return 1.0
    if not config.partial_credit or not all(run.passed[t] for t in task.pass_to_pass):
        return 0.0
    share = sum(run.passed[t] for t in task.fail_to_pass) / len(task.fail_to_pass)
    return 0.0 if share == 1.0 else share  # all passed yet a failing exit: evidence conflicts


NOT_GRADED = Grade(
    reward=None, resolved=False, f2p=(), p2p=(), guards=(), dropped=(), applied=False,
    timed_out=False, exit_code=None, error="", not_isolated=(), duration_s=0.0, diff="", output="",
)  # fmt: skip


def grade(task: CodingTask, diff: str, config: GradeConfig | None = None) -> Grade:
    """Judge `diff` against `task` in a fresh sandbox of its own."""
    config = config or GradeConfig()
    start = time.monotonic()

    def timed(g: Grade) -> Grade:
        return replace(g, duration_s=time.monotonic() - start)

    if not task.fail_to_pass:
        return timed(
            replace(NOT_GRADED, error=f"task {task.instance_id!r} lists no FAIL_TO_PASS tests")
        )
    try:
        sandbox = prepare(task, config.sandbox)
    except SandboxError as err:
        return timed(replace(NOT_GRADED, error=str(err)))
    with sandbox:
        kept = screen(diff, sandbox.test_patch, config.forbidden)
        screened = replace(NOT_GRADED, guards=kept.guards, dropped=kept.dropped, diff=kept.diff,
                           not_isolated=sandbox.not_isolated)  # fmt: skip
        try:
            apply_patch(sandbox.workdir, kept.diff, what="diff")
        except GitError as err:
            return timed(replace(screened, reward=0.0, error=str(err)))
        try:
            apply_patch(sandbox.workdir, sandbox.test_patch, what="test patch")
        except GitError as err:
            error = f"task {task.instance_id!r} is broken: {err}"
            return timed(replace(screened, applied=True, error=error))
        run = run_tests(
            sandbox, tuple(dict.fromkeys(task.fail_to_pass + task.pass_to_pass)), config
        )
    reward = _verdict(task, run, config, zeroed="forbidden_code" in kept.guards)
    return timed(replace(
        screened, reward=reward, resolved=reward == 1.0, applied=True,
        f2p=tuple((t, run.passed[t]) for t in task.fail_to_pass),
        p2p=tuple((t, run.passed[t]) for t in task.pass_to_pass),
        guards=tuple(sorted({*kept.guards, *(["time_limit"] if run.timed_out else [])})),
        timed_out=run.timed_out, exit_code=run.exit_code, output=run.output,
    ))  # fmt: skip


def grade_run(sandbox: Sandbox, config: GradeConfig | None = None) -> Grade:
    """Grade what an agent left in its sandbox: our diff of it, judged in a new sandbox."""
    return grade(sandbox.task, diff_of(sandbox), config)
