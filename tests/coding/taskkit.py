"""Builds small inline coding tasks for tests: base files, the fixed files, tests before and after."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from harnessrl.coding.repo import commit_tree, git
from harnessrl.coding.sandbox import SandboxConfig, bwrap_problem
from harnessrl.coding.tasks import CodingTask

needs_bwrap = pytest.mark.skipif(bool(bwrap_problem()), reason=bwrap_problem() or "bwrap works")


def make_task(
    instance_id: str,
    base: dict[str, str],
    fixed: dict[str, str],
    tests_after: dict[str, str],
    fail_to_pass: tuple[str, ...],
    pass_to_pass: tuple[str, ...] = (),
    **kw: object,
) -> CodingTask:
    """`base` is the buggy tree (with the tests an agent may see); `fixed` the changed source files;
    `tests_after` the test files as the test patch leaves them."""
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        git(repo, "init", "-q", "-b", "main")
        base_commit = commit_tree(repo, base, "base")
        for rel, text in fixed.items():
            (repo / rel).write_text(text)
        patch = git(repo, "diff", "--full-index", "--", *fixed) if fixed else ""
        git(repo, "checkout", "-q", "--", ".")
        for rel, text in tests_after.items():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            (repo / rel).write_text(text)
        git(repo, "add", "-A")
        test_patch = git(repo, "diff", "--cached", "--full-index")
    return CodingTask(
        instance_id=instance_id,
        problem_statement=f"fix {instance_id}",
        patch=patch,
        test_patch=test_patch,
        fail_to_pass=fail_to_pass,
        pass_to_pass=pass_to_pass,
        base_commit=base_commit,
        files=tuple(sorted(base.items())),
        **kw,  # type: ignore[arg-type]
    )


def value_task(instance_id: str = "value-task", extra_test: str = "") -> CodingTask:
    """`value()` returns 0 but should return 1; one visible test, one hidden (plus `extra_test`)."""
    visible = "from value import value, other\n\n\ndef test_other():\n    assert other() == 2\n"
    hidden = visible + "\n\ndef test_value():\n    assert value() == 1\n" + extra_test
    f2p = ["test_value.py::test_value"]
    if extra_test:
        f2p += [f"test_value.py::{line[4:].split('(')[0]}" for line in extra_test.splitlines()
                if line.startswith("def test_")]  # fmt: skip
    return make_task(
        instance_id,
        base={
            "value.py": "def value():\n    return 0\n\n\ndef other():\n    return 2\n",
            "test_value.py": visible,
        },
        fixed={"value.py": "def value():\n    return 1\n\n\ndef other():\n    return 2\n"},
        tests_after={"test_value.py": hidden},
        fail_to_pass=tuple(f2p),
        pass_to_pass=("test_value.py::test_other",),
    )


def config(tmp_path: Path, **kw: object) -> SandboxConfig:
    return SandboxConfig(root=str(tmp_path / "sandboxes"), **kw)  # type: ignore[arg-type]
