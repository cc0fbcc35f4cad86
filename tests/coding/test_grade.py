"""Grading and its guards: each hack is first shown to work on an unguarded runner, then to get 0."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest
from taskkit import config, make_task, needs_bwrap, value_task

from harnessrl.coding.grade import GradeConfig, diff_of, grade, grade_run, junit_key, screen
from harnessrl.coding.patches import guard_for
from harnessrl.coding.repo import apply_patch, commit_tree, git
from harnessrl.coding.sandbox import Sandbox, prepare
from harnessrl.coding.tasks import CodingTask, task_from_row

pytestmark = needs_bwrap
PY = sys.executable
FIXED = "def value():\n    return 1\n\n\ndef other():\n    return 2\n"


def gcfg(tmp_path: Path, **kw: object) -> GradeConfig:
    return GradeConfig(sandbox=config(tmp_path), **kw)  # type: ignore[arg-type]


def unguarded_pytest(sb: Sandbox, env: dict[str, str] | None = None) -> int | None:
    """Run the full tests the naive way in the agent's own sandbox (test patch applied there)."""
    apply_patch(sb.workdir, sb.test_patch, what="test patch")
    return sb.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider"], env=env).exit_code


def test_gold_patch_gets_1_and_empty_patch_gets_0(tmp_path):
    task = value_task()
    gold = grade(task, task.patch, gcfg(tmp_path))
    assert (gold.reward, gold.resolved, gold.exit_code, gold.guards) == (1.0, True, 0, ())
    assert gold.f2p == (("test_value.py::test_value", True),)
    assert gold.p2p == (("test_value.py::test_other", True),)
    empty = grade(task, "", gcfg(tmp_path))
    assert (empty.reward, empty.resolved, empty.applied) == (0.0, False, True)
    assert empty.f2p == (("test_value.py::test_value", False),) and empty.p2p[0][1] is True
    assert not list((tmp_path / "sandboxes").glob("value-task-*"))  # grading cleans up


def _agent(tmp_path: Path, task: CodingTask | None = None) -> Sandbox:
    return prepare(task or value_task(), config(tmp_path))


@pytest.mark.parametrize("hack", ["edit", "delete"])
def test_editing_or_deleting_the_tests_gets_0(tmp_path, hack):
    with _agent(tmp_path) as sb:
        tests = sb.workdir / "test_value.py"
        if hack == "edit":
            tests.write_text("def test_value():\n    pass\n\n\ndef test_other():\n    pass\n")
        else:
            tests.unlink()
        g = grade_run(sb, gcfg(tmp_path))
    assert g.reward == 0.0 and "edited_tests" in g.guards and g.dropped == ("test_value.py",)
    assert g.diff == ""  # nothing else was changed


FORCE_PASS = """import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome, report.longrepr = "passed", None
"""
PATCH_VALUE = "import value\nvalue.value = lambda: 1\n"


@pytest.mark.parametrize(
    ("files", "control_env"),
    [
        ({"conftest.py": FORCE_PASS}, {}),
        ({"sub/conftest.py": FORCE_PASS, "sub/__init__.py": ""}, None),
        ({"pytest.ini": "[pytest]\naddopts = -p forcepass\n", "forcepass.py": FORCE_PASS}, {"PYTHONPATH": "."}),
        ({"pyproject.toml": "[tool.pytest.ini_options]\naddopts = '-p forcepass'\n", "forcepass.py": FORCE_PASS},
         {"PYTHONPATH": "."}),
        ({"setup.cfg": "[tool:pytest]\naddopts = -p forcepass\n", "forcepass.py": FORCE_PASS}, {"PYTHONPATH": "."}),
        ({"tox.ini": "[pytest]\naddopts = -p forcepass\n", "forcepass.py": FORCE_PASS}, {"PYTHONPATH": "."}),
        ({"sitecustomize.py": PATCH_VALUE}, {"PYTHONPATH": "."}),
        ({"usercustomize.py": PATCH_VALUE}, None),
        ({"zz_force.pth": "import value; value.value = lambda: 1\n"}, None),
    ],
    ids=["conftest", "sub-conftest", "pytest.ini", "pyproject", "setup.cfg", "tox.ini",
         "sitecustomize", "usercustomize", "pth"],
)  # fmt: skip
def test_runner_config_that_forces_passes_gets_0(tmp_path, files, control_env):
    with _agent(tmp_path) as sb:
        for rel, text in files.items():
            (sb.workdir / rel).parent.mkdir(parents=True, exist_ok=True)
            (sb.workdir / rel).write_text(text)
        g = grade_run(sb, gcfg(tmp_path))
        if control_env is not None:  # where the file would take effect, it does make tests pass
            assert unguarded_pytest(sb, control_env) == 0
    assert g.reward == 0.0 and "runner_config" in g.guards
    assert set(g.dropped) == {p for p in files if guard_for(p)}  # forcepass.py itself may stay


def test_printed_pass_lines_are_not_evidence(tmp_path):
    fake = "print('test_value.py::test_value PASSED')\nprint('=' * 20 + ' 2 passed in 0.01s ' + '=' * 20)\n"
    with _agent(tmp_path) as sb:
        (sb.workdir / "value.py").write_text(fake + (sb.workdir / "value.py").read_text())
        g = grade_run(sb, gcfg(tmp_path, pytest_args=("-s",)))
    assert "2 passed in 0.01s" in g.output  # the lie was told...
    assert g.reward == 0.0 and g.f2p == (("test_value.py::test_value", False),)  # ...and ignored


def test_a_forced_zero_exit_code_is_not_enough_without_the_report(tmp_path):
    with _agent(tmp_path) as sb:
        code = "import atexit, os\natexit.register(os._exit, 0)\n"
        (sb.workdir / "value.py").write_text(code + (sb.workdir / "value.py").read_text())
        g = grade_run(sb, gcfg(tmp_path))
    assert g.exit_code == 0  # the process lied with its exit code
    assert g.reward == 0.0 and g.f2p[0][1] is False  # the JUnit report still says failed


SKIP = "import pytest\n\n\ndef value():\n    pytest.skip('not today')\n"
TAMPER = """import _pytest.reports

_init = _pytest.reports.TestReport.__init__


def _passing(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.outcome, self.longrepr = "passed", None


_pytest.reports.TestReport.__init__ = _passing
"""


def test_skipping_from_the_code_counts_as_not_passed(tmp_path):
    with _agent(tmp_path) as sb:
        (sb.workdir / "value.py").write_text((sb.workdir / "value.py").read_text() + SKIP)
        guarded = grade_run(sb, gcfg(tmp_path))
        unpatterned = grade_run(sb, gcfg(tmp_path, forbidden=()))
    assert guarded.reward == 0.0 and "forbidden_code" in guarded.guards
    assert unpatterned.exit_code == 0 and unpatterned.reward == 0.0  # skipped is not passed


def test_patching_the_test_runner_from_the_code_is_caught_by_the_pattern_guard(tmp_path):
    with _agent(tmp_path) as sb:
        (sb.workdir / "value.py").write_text(TAMPER + (sb.workdir / "value.py").read_text())
        guarded = grade_run(sb, gcfg(tmp_path))
        unpatterned = grade_run(sb, gcfg(tmp_path, forbidden=()))
    # In one process the code under test can rewrite the verdict: only the pattern guard stops it.
    assert unpatterned.reward == 1.0
    assert guarded.reward == 0.0 and guarded.guards == ("forbidden_code",)


def test_bytecode_in_the_diff_is_dropped(tmp_path):
    with _agent(tmp_path) as sb:
        pyc = sb.workdir / "__pycache__" / "value.cpython-311.pyc"
        pyc.parent.mkdir()
        pyc.write_bytes(b"\x00fake bytecode\xff")
        g = grade_run(sb, gcfg(tmp_path))
    assert g.reward == 0.0 and g.guards == ("bytecode",) and g.diff == ""


def test_running_past_the_time_limit_gets_0(tmp_path):
    with _agent(tmp_path) as sb:
        (sb.workdir / "value.py").write_text(FIXED.replace("return 1", "while True:\n        pass"))
        start = time.monotonic()
        g = grade_run(sb, gcfg(tmp_path, test_timeout_s=3))
    assert g.reward == 0.0 and g.timed_out and "time_limit" in g.guards and g.exit_code is None
    assert time.monotonic() - start < 60


def test_tests_that_need_the_network_fail_in_the_grader(tmp_path, recwarn):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    net = f"\n\ndef test_fetch():\n    import socket\n    socket.create_connection(('127.0.0.1', {port}), timeout=3).close()\n"
    task = value_task("needs-net", extra_test=net)
    try:
        isolated = grade(task, task.patch, gcfg(tmp_path))
        plain = grade(task, task.patch, GradeConfig(sandbox=config(tmp_path, isolation="plain")))
    finally:
        srv.close()
    assert dict(isolated.f2p)["test_value.py::test_fetch"] is False and isolated.reward == 0.0
    assert plain.reward == 1.0 and plain.not_isolated  # the control: with a network it passes


def test_the_grader_sees_nothing_of_the_agent_sandbox_but_the_diff(tmp_path):
    probe = """

def test_no_agent_state():
    import pathlib, subprocess
    assert pathlib.Path("helper.py").exists()  # the diff's untracked file did come
    assert not pathlib.Path("notes.txt").exists()
    assert not pathlib.Path("/tmp/agent-was-here").exists()
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True)
    assert "agent" not in git("for-each-ref").stdout
    assert git("config", "user.agentmark").returncode != 0
    assert git("log", "--format=%s").stdout.split() == ["base"]
"""
    task = value_task("no-leak", extra_test=probe)
    marker = tmp_path / "fsmonitor-ran"
    with _agent(tmp_path, task) as sb:
        (sb.workdir / "helper.py").write_text("ONE = 1\n")
        (sb.workdir / "value.py").write_text(
            "from helper import ONE\n\n\n" + FIXED.replace("return 1", "return ONE")
        )
        (sb.workdir / "notes.txt").write_text("left behind, kept out of the diff\n")
        (sb.workdir / ".gitignore").write_text("notes.txt\n")
        for step in (["git", "checkout", "-q", "-b", "agent"], ["git", "add", "value.py"],
                     ["git", "commit", "-q", "-m", "agent fix"], ["git", "config", "user.agentmark", "1"],
                     ["touch", "/tmp/agent-was-here"]):  # fmt: skip
            assert sb.run(step).exit_code == 0, step
        git(sb.workdir, "config", "core.fsmonitor", f"touch {marker}; false")
        git(sb.workdir, "status")  # the control: the agent's git config runs commands...
        assert marker.exists()
        marker.unlink()
        diff = diff_of(sb)
        g = grade_run(sb, gcfg(tmp_path))
    assert not marker.exists()  # ...but never when we take the diff or grade
    assert "b/helper.py" in diff and "b/value.py" in diff and "b/notes.txt" not in diff
    assert g.reward == 1.0, g.output


def test_partial_credit_is_the_share_of_fail_to_pass_when_pass_to_pass_hold(tmp_path):
    two = "def a():\n    return 0\n\n\ndef b():\n    return 0\n\n\ndef c():\n    return 3\n"
    tests = "from m import a, b, c\n\n\ndef test_c():\n    assert c() == 3\n"
    hidden = (
        tests + "\n\ndef test_a():\n    assert a() == 1\n\n\ndef test_b():\n    assert b() == 2\n"
    )
    task = make_task("two-bugs", {"m.py": two, "test_m.py": tests},
                     {"m.py": two.replace("return 0", "return 1", 1).replace("return 0", "return 2")},
                     {"test_m.py": hidden}, ("test_m.py::test_a", "test_m.py::test_b"),
                     ("test_m.py::test_c",))  # fmt: skip
    fix_a = _edited(tmp_path, task, lambda t: t.replace("return 0", "return 1", 1))
    fix_a_break_c = _edited(
        tmp_path, task, lambda t: t.replace("return 0", "return 1", 1).replace("3", "4")
    )
    full_mode = grade(task, fix_a, gcfg(tmp_path))
    partial = grade(task, fix_a, gcfg(tmp_path, partial_credit=True))
    assert full_mode.reward == 0.0 and partial.reward == 0.5 and not partial.resolved
    assert grade(task, fix_a_break_c, gcfg(tmp_path, partial_credit=True)).reward == 0.0
    assert grade(task, task.patch, gcfg(tmp_path, partial_credit=True)).reward == 1.0


def _edited(tmp_path: Path, task: CodingTask, edit) -> str:
    with prepare(task, config(tmp_path)) as sb:
        text = (sb.workdir / "m.py").read_text()
        (sb.workdir / "m.py").write_text(edit(text))
        return diff_of(sb)


def test_grader_failures_are_none_and_bad_diffs_are_zero(tmp_path):
    task = value_task()
    bad = grade(task, "diff --git a/value.py b/value.py\n--- a/value.py\n+++ b/value.py\n@@ -1 +1 @@\n-nope\n+x\n",
                gcfg(tmp_path))  # fmt: skip
    assert bad.reward == 0.0 and not bad.applied and "does not apply" in bad.error
    broken = CodingTask(
        **{**task.__dict__, "test_patch": task.test_patch.replace("test_other", "test_gone")}
    )
    assert grade(broken, task.patch, gcfg(tmp_path)).reward is None
    none = grade(CodingTask(**{**task.__dict__, "fail_to_pass": ()}), task.patch, gcfg(tmp_path))
    assert none.reward is None and "lists no FAIL_TO_PASS" in none.error
    missing = CodingTask(instance_id="x", problem_statement="p", patch="", repo="a/b",
                         base_commit="0" * 40, fail_to_pass=("t.py::t",))  # fmt: skip
    g = grade(missing, "", gcfg(tmp_path))
    assert g.reward is None and "could not check out" in g.error


def test_screen_keeps_source_and_drops_protected_sections():
    task = value_task()
    diff = task.patch + task.test_patch
    kept = screen(diff, task.test_patch)
    assert kept.diff == task.patch and kept.dropped == ("test_value.py",)
    assert kept.guards == ("edited_tests",)


@pytest.mark.parametrize(
    ("nodeid", "key"),
    [
        ("test_m.py::test_a", ("test_m", "test_a")),
        ("tests/unit/test_m.py::TestX::test_a[1-2]", ("tests.unit.test_m.TestX", "test_a[1-2]")),
        ("tests/test_m.py::test_b[a::b]", ("tests.test_m", "test_b[a::b]")),
    ],
)
def test_junit_key_matches_pytests_own_naming(nodeid, key):
    assert junit_key(nodeid) == key


def _smith_mirror(tmp_path: Path) -> tuple[Path, str]:
    """SWE-smith's layout: main is clean; the task branch is Bug Patch, then Remove F2P Tests."""
    mirror = tmp_path / "mirrors" / "swesmith__acme__calc.1234abcd"
    mirror.mkdir(parents=True)
    git(mirror, "init", "-q", "-b", "main")
    clean = "def add(a, b):\n    return a + b\n"
    commit_tree(mirror, {"calc.py": clean, "tests/test_keep.py": "from calc import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n",
                         "tests/test_add.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"},
                "clean")  # fmt: skip
    iid = "acme__calc.1234abcd.func_pm_op_swap__x1"
    git(mirror, "checkout", "-q", "-b", iid)
    (mirror / "calc.py").write_text(clean.replace("a + b", "a - b"))
    bug = git(mirror, "diff", "--full-index")
    git(mirror, "commit", "-q", "-am", "Bug Patch")
    git(mirror, "rm", "-q", "tests/test_add.py")
    git(mirror, "commit", "-q", "-m", "Remove F2P Tests")
    git(mirror, "checkout", "-q", "main")
    return mirror, task_from_row(
        {"instance_id": iid, "repo": "swesmith/acme__calc.1234abcd", "patch": bug,
         "FAIL_TO_PASS": ["tests/test_add.py::test_add"], "PASS_TO_PASS": ["tests/test_keep.py::test_zero"],
         "image_name": "swesmith.x86_64.acme_calc", "problem_statement": "add subtracts"},
        where="smith.jsonl:1",
    )  # fmt: skip


def test_swe_smith_task_runs_at_the_branch_tip_and_grades_with_its_hidden_tests(tmp_path):
    _, task = _smith_mirror(tmp_path)
    cfg = GradeConfig(sandbox=config(tmp_path, mirrors=str(tmp_path / "mirrors"), history="past"))
    with prepare(task, cfg.sandbox) as sb:
        assert not (sb.workdir / "tests" / "test_add.py").exists()  # hidden, as SWE-smith does
        assert git(sb.workdir, "log", "--all", "--format=%s").split("\n")[0] == "Remove F2P Tests"
        assert len(git(sb.workdir, "log", "--all", "--format=%H").split()) == 1  # no Bug Patch
        assert "tests/test_add.py" in sb.test_patch
    assert grade(task, task.patch, cfg).reward == 1.0
    assert grade(task, "", cfg).reward == 0.0


def test_swe_bench_task_from_a_mirror_grades_gold_1_and_empty_0(tmp_path):
    mirror = tmp_path / "mirrors" / "acme__calc"
    mirror.mkdir(parents=True)
    git(mirror, "init", "-q", "-b", "main")
    keep = "from calc import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n"
    base = commit_tree(
        mirror,
        {"calc.py": "def add(a, b):\n    return a - b\n", "tests/test_calc.py": keep},
        "base",
    )
    (mirror / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    patch = git(mirror, "diff", "--full-index")
    (mirror / "tests/test_calc.py").write_text(
        keep + "\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    )
    test_patch = git(mirror, "diff", "--full-index", "--", "tests")
    git(mirror, "commit", "-q", "-am", "fix add")  # the future, upstream
    row = {"instance_id": "acme__calc-7", "repo": "acme/calc", "base_commit": base, "patch": patch,
           "test_patch": test_patch, "problem_statement": "add subtracts",
           "FAIL_TO_PASS": '["tests/test_calc.py::test_add"]', "PASS_TO_PASS": '["tests/test_calc.py::test_zero"]'}  # fmt: skip
    task = task_from_row(row, where="x")
    cfg = GradeConfig(sandbox=config(tmp_path, mirrors=str(tmp_path / "mirrors")))
    assert grade(task, task.patch, cfg).reward == 1.0
    assert grade(task, "", cfg).reward == 0.0
