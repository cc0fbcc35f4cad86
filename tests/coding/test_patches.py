from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harnessrl.coding.patches import guard_for, patch_paths, reverse_patch, split_diff
from harnessrl.coding.repo import apply_patch, commit_tree, git


def _repo(tmp_path: Path, files: dict[str, str]) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    commit_tree(repo, files, "base")
    return repo


def _tree(repo: Path) -> dict[str, str]:
    return {
        p.relative_to(repo).as_posix(): p.read_text()
        for p in sorted(repo.rglob("*"))
        if p.is_file() and ".git" not in p.relative_to(repo).parts
    }


def test_split_diff_names_each_file_including_new_deleted_and_spaced_paths(tmp_path):
    repo = _repo(tmp_path, {"a.py": "x = 1\n", "gone.py": "y\n", "dir/with space.py": "z\n"})
    (repo / "a.py").write_text("x = 2\n")
    (repo / "gone.py").unlink()
    (repo / "new.py").write_text("n\n")
    (repo / "dir/with space.py").write_text("zz\n")
    (repo / "tést.py").write_text("accent\n")
    git(repo, "add", "-A")
    diff = git(repo, "diff", "--cached", "--no-renames")
    sections = split_diff("junk before the first header\n" + diff)
    assert [s.paths for s in sections] == [
        ("a.py",), ("dir/with space.py",), ("gone.py",), ("new.py",), ("tést.py",),
    ]  # fmt: skip
    assert "".join(s.text for s in sections) == diff
    assert patch_paths(diff) == {"a.py", "dir/with space.py", "gone.py", "new.py", "tést.py"}


def test_split_diff_reads_mode_only_and_renamed_sections(tmp_path):
    repo = _repo(tmp_path, {"run.sh": "echo\n", "old.py": "a = 1\n" * 20})
    (repo / "run.sh").chmod(0o755)
    git(repo, "mv", "old.py", "new.py")
    git(repo, "add", "-A")
    diff = git(repo, "diff", "--cached", "-M")
    assert {s.paths for s in split_diff(diff)} == {("run.sh",), ("old.py", "new.py")}


EDIT = st.lists(st.sampled_from(["keep", "drop", "change", "add"]), min_size=1, max_size=30)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lines=st.lists(st.text("abc xyz", min_size=0, max_size=8), min_size=0, max_size=30),
    edits=EDIT,
    trailing_newline=st.booleans(),
)
def test_reverse_patch_undoes_any_text_edit_under_git_apply(
    tmp_path_factory, lines, edits, trailing_newline
):
    tmp = tmp_path_factory.mktemp("rev")
    before = "\n".join(lines) + ("\n" if trailing_newline or not lines else "")
    repo = _repo(tmp, {"f.txt": before, "deleted.txt": "bye\n"})
    after_lines = []
    for i, line in enumerate(lines):
        edit = edits[i % len(edits)]
        if edit == "keep":
            after_lines.append(line)
        elif edit == "change":
            after_lines.append(line + "!")
        elif edit == "add":
            after_lines += [line, "added"]
    (repo / "f.txt").write_text("\n".join(after_lines) + ("\n" if edits[0] != "drop" else ""))
    (repo / "deleted.txt").unlink()
    (repo / "created.txt").write_text("hello\n")
    git(repo, "add", "-A")
    forward = git(repo, "diff", "--cached")
    git(repo, "commit", "-q", "-m", "after")
    if not forward:
        return
    apply_patch(repo, reverse_patch(forward), what="reversed patch")
    assert _tree(repo) == {"f.txt": before, "deleted.txt": "bye\n"}


def test_reverse_patch_swaps_modes_and_renames_and_refuses_binary(tmp_path):
    repo = _repo(tmp_path, {"run.sh": "echo\n"})
    (repo / "run.sh").chmod(0o755)
    git(repo, "add", "-A")
    forward = git(repo, "diff", "--cached")
    git(repo, "commit", "-q", "-m", "exec")
    apply_patch(repo, reverse_patch(forward), what="reversed mode change")
    assert not (repo / "run.sh").stat().st_mode & 0o111
    body = "".join(f"echo {i}\n" for i in range(10))
    (repo / "run.sh").write_text(body)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "longer")
    git(repo, "mv", "run.sh", "start.sh")
    (repo / "start.sh").write_text(body + "echo again\n")
    git(repo, "add", "-A")
    renamed = git(repo, "diff", "--cached", "-M")
    assert "rename from run.sh" in renamed
    git(repo, "commit", "-q", "-m", "rename")
    apply_patch(repo, reverse_patch(renamed), what="reversed rename")
    assert _tree(repo) == {"run.sh": body}
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "back")
    (repo / "blob.bin").write_bytes(bytes(range(256)))
    git(repo, "add", "-A")
    with pytest.raises(ValueError, match="binary"):
        reverse_patch(git(repo, "diff", "--cached", "--binary"))
    with pytest.raises(ValueError, match="no 'diff --git' sections"):
        reverse_patch("--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n")


@pytest.mark.parametrize(
    ("path", "guard"),
    [
        ("pkg/module.py", None),
        ("django/test/utils.py", None),  # a source package named test, not a test folder
        ("numpy/testing/utils.py", None),
        ("test_value.py", "edited_tests"),
        ("pkg/value_test.py", "edited_tests"),
        ("tests/data/fixture.json", "edited_tests"),
        ("pkg/tests/helpers.py", "edited_tests"),
        ("conftest.py", "runner_config"),
        ("sub/conftest.py", "runner_config"),
        ("sitecustomize.py", "runner_config"),
        ("usercustomize.py", "runner_config"),
        ("evil.pth", "runner_config"),
        ("pytest.ini", "runner_config"),
        ("tox.ini", "runner_config"),
        ("setup.cfg", "runner_config"),
        ("pyproject.toml", "runner_config"),
        ("__pycache__/value.cpython-311.pyc", "bytecode"),
        ("value.pyc", "bytecode"),
    ],
)
def test_guard_for_classifies_paths(path, guard):
    assert guard_for(path) == guard


def test_guard_for_protects_whatever_the_test_patch_touches():
    assert guard_for("data/expected.txt") is None
    assert guard_for("data/expected.txt", frozenset({"data/expected.txt"})) == "edited_tests"
