from __future__ import annotations

import json

import pytest

from harnessrl.coding.patches import reverse_patch
from harnessrl.coding.tasks import (
    CodingTask,
    RowError,
    load_tasks,
    read_jsonl,
    read_task_dir,
    task_from_row,
    write_jsonl,
    write_task_dir,
)

PATCH = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 0\n+x = 1\n"
TEST_PATCH = (
    "diff --git a/tests/test_m.py b/tests/test_m.py\n--- a/tests/test_m.py\n"
    "+++ b/tests/test_m.py\n@@ -1 +1,2 @@\n import m\n+def test_x(): assert m.x == 1\n"
)


def swe_bench_row(**over):
    row = {
        "instance_id": "astropy__astropy-12907",
        "repo": "astropy/astropy",
        "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
        "problem_statement": "Modeling's separability_matrix does not compute correctly",
        "patch": PATCH,
        "test_patch": TEST_PATCH,
        # SWE-bench's own JSONL stores the test lists as JSON text
        "FAIL_TO_PASS": json.dumps(["tests/test_m.py::test_x"]),
        "PASS_TO_PASS": json.dumps(["tests/test_m.py::test_y", "tests/test_m.py::test_z[1-2]"]),
        "created_at": "2022-03-03T15:14:54Z",
        "version": "4.3",
        "environment_setup_commit": "298ccb478e6bf092953bca67a3d29dc6c35f6752",
        "hints_text": "",
    }
    row.update(over)
    return row


def smith_row(**over):
    row = {
        "instance_id": "pylint-dev__astroid.b114f6b5.func_basic__abc123",
        "repo": "swesmith/pylint-dev__astroid.b114f6b5",
        "patch": reverse_patch(PATCH),  # SWE-smith's patch plants the bug
        "FAIL_TO_PASS": ["tests/test_m.py::test_x"],
        "PASS_TO_PASS": ["tests/test_m.py::test_y"],
        "image_name": "jyangballin/swesmith.x86_64.pylint-dev_1776_astroid.b114f6b5",
        "problem_statement": "",
    }
    row.update(over)
    return row


def test_swe_bench_row_reads_json_encoded_test_lists_and_keeps_the_rest_as_meta():
    task = task_from_row(swe_bench_row(), where="rows.jsonl:1")
    assert task.kind == "swe-bench"
    assert task.fail_to_pass == ("tests/test_m.py::test_x",)
    assert task.pass_to_pass == ("tests/test_m.py::test_y", "tests/test_m.py::test_z[1-2]")
    assert task.patch == PATCH and task.test_patch == TEST_PATCH
    assert task.meta["created_at"] == "2022-03-03T15:14:54Z" and task.meta["version"] == "4.3"
    listed = task_from_row(
        swe_bench_row(FAIL_TO_PASS=list(task.fail_to_pass), PASS_TO_PASS=list(task.pass_to_pass)),
        where="x",
    )
    assert listed == task


def test_v5_rows_carry_image_and_eval_script():
    task = task_from_row(
        swe_bench_row(image="swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:v5",
                      eval_script="#!/bin/bash\npytest tests/test_m.py\n"),
        where="x",
    )  # fmt: skip
    assert task.image.endswith(":v5") and task.eval_script.startswith("#!/bin/bash")


def test_swe_smith_row_stores_the_fix_as_the_reversed_bug_patch_and_its_branch():
    task = task_from_row(smith_row(), where="smith.jsonl:4")
    assert task.kind == "swe-smith"
    assert task.patch == PATCH  # the fix undoes the planted bug
    assert task.branch == task.instance_id and task.base_commit == ""
    assert task.image.startswith("jyangballin/swesmith")
    assert task_from_row(smith_row(branch="bug-7"), where="x").branch == "bug-7"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (swe_bench_row(patch=None), r"rows.jsonl:3 \(instance 'astropy__astropy-12907'\): missing required field 'patch'"),
        ({k: v for k, v in swe_bench_row().items() if k != "base_commit"}, "missing required field 'base_commit'"),
        (swe_bench_row(problem_statement=7), "field 'problem_statement' must be a string, got int"),
        (swe_bench_row(FAIL_TO_PASS="[not json"), "field 'FAIL_TO_PASS' is a string but not a JSON list"),
        (swe_bench_row(PASS_TO_PASS=[1, 2]), "field 'PASS_TO_PASS' must be a list of non-empty test ids"),
        (swe_bench_row(FAIL_TO_PASS=[""]), "field 'FAIL_TO_PASS' must be a list of non-empty test ids"),
        (swe_bench_row(instance_id="../escape"), "instance_id must be non-empty, without '/'"),
        (swe_bench_row(files={"../x.py": ""}), "path '../x.py' must stay inside the repo"),
        (swe_bench_row(files={"a.py": 3}), "field 'files' must map paths to file text"),
        (smith_row(repo=None), "missing required field 'repo'"),
        (smith_row(patch="--- a/x\n+++ b/x\n"), "no 'diff --git' sections"),
        (["not", "an", "object"], "must be a JSON object, got list"),
        ({"repo": "a/b"}, "missing required field 'instance_id'"),
    ],
)  # fmt: skip
def test_malformed_rows_name_the_row_and_the_field(row, message):
    with pytest.raises(RowError, match=message):
        task_from_row(row, where="rows.jsonl:3")


def test_read_jsonl_names_the_line_of_bad_json_and_of_duplicates(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(swe_bench_row()) + "\n\n{oops\n")
    with pytest.raises(RowError, match=r"tasks.jsonl:3: not valid JSON"):
        read_jsonl(path)
    path.write_text(json.dumps(swe_bench_row()) + "\n" + json.dumps(swe_bench_row()) + "\n")
    with pytest.raises(RowError, match=r"tasks.jsonl:2: instance .* already on line 1"):
        read_jsonl(path)
    with pytest.raises(ValueError, match="does not exist"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_rows_written_by_us_read_back_equal_for_every_kind(tmp_path):
    inline = CodingTask(
        instance_id="inline-1", problem_statement="p", patch=PATCH, test_patch=TEST_PATCH,
        fail_to_pass=("tests/test_m.py::test_x",), files=(("m.py", "x = 0\n"),), setup="true",
    )  # fmt: skip
    tasks = [
        task_from_row(swe_bench_row(), where="x"),
        task_from_row(smith_row(), where="x"),
        inline,
    ]
    write_jsonl(tasks, tmp_path / "out.jsonl")
    back = read_jsonl(tmp_path / "out.jsonl")
    assert back == tasks and [t.kind for t in back] == ["swe-bench", "swe-smith", "inline"]
    assert back[0].meta == tasks[0].meta


def test_task_folders_round_trip_and_load_tasks_reads_all_three_shapes(tmp_path):
    inline = CodingTask(
        instance_id="inline-1", problem_statement="Fix m.\n", patch=PATCH, test_patch=TEST_PATCH,
        fail_to_pass=("tests/test_m.py::test_x",), pass_to_pass=("tests/test_m.py::test_y",),
        files=(("m.py", "x = 0\n"), ("tests/test_m.py", "import m\n")), setup="pip --version\n",
    )  # fmt: skip
    smith = task_from_row(smith_row(), where="x")
    root = tmp_path / "tasks"
    folder = write_task_dir(inline, root)
    write_task_dir(smith, root)
    assert sorted(p.name for p in folder.iterdir()) == [
        "gold.patch", "problem_statement.md", "repo", "setup.sh", "task.json", "test.patch", "tests.json",
    ]  # fmt: skip
    assert (folder / "repo" / "tests" / "test_m.py").read_text() == "import m\n"
    assert read_task_dir(folder) == inline
    assert load_tasks(root) == [inline, smith]  # folder names sort inline-1 < pylint-dev...
    assert load_tasks(folder) == [inline]
    write_jsonl([inline], tmp_path / "t.jsonl")
    assert load_tasks(tmp_path / "t.jsonl") == [inline]


def test_task_folder_errors_name_the_folder(tmp_path):
    d = tmp_path / "broken"
    d.mkdir()
    with pytest.raises(RowError, match=r"task folder .*broken.*missing problem_statement.md"):
        read_task_dir(d)
    (d / "problem_statement.md").write_text("p")
    with pytest.raises(RowError, match=r"needs tests\.json"):
        read_task_dir(d)
    (d / "tests.json").write_text('{"FAIL_TO_PASS": ["t.py::t"], "PASS_TO_PASS": []}')
    with pytest.raises(RowError, match=r"missing gold\.patch"):
        read_task_dir(d)
    (d / "gold.patch").write_text(PATCH)
    with pytest.raises(RowError, match="missing required field 'repo'"):
        read_task_dir(d)
    (d / "task.json").write_text("{bad")
    with pytest.raises(RowError, match="not valid JSON"):
        read_task_dir(d)
