"""The cleaning CLI on files with planted defects: exactly the planted rows go, at their own step.

The SWE-bench-like file is built from the shipped HumanEval bug set (inline repositories), the
SWE-smith-like file from a mirror with one branch per bug; the gold-patch and FAIL_TO_PASS checks
grade for real in sandboxes.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from harnessrl.coding.grade import GradeConfig
from harnessrl.coding.repo import commit_tree, git
from harnessrl.coding.sandbox import SandboxConfig
from harnessrl.coding.taskset import load_shipped
from harnessrl.curate.clean import (
    CleanConfig,
    DecontaminateFilter,
    LicenseFilter,
    SourceFilter,
    clean,
    main,
)

# Where bubblewrap cannot run, sandboxes fall back to plain processes (and warn): the verdicts
# these tests check are the same either way.
pytestmark = pytest.mark.filterwarnings("ignore:coding sandboxes run as plain processes")
SMITH_REPO = "swesmith/acme__calc.1234abcd"
SMITH_PREFIX = "acme__calc.1234abcd"


def grading(tmp_path: Path, mirrors: str = "") -> GradeConfig:
    sandbox = SandboxConfig(root=str(tmp_path / "sandboxes"), mirrors=mirrors)
    return GradeConfig(sandbox=sandbox, plugin_autoload=False, test_timeout_s=60)


def write_lines(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def dropped_by_step(report_path: Path) -> dict[str, set[str]]:
    report = json.loads(report_path.read_text())
    for step in report["steps"]:  # the counts agree with the ids listed
        assert step["rows_in"] - step["rows_out"] == len(step["dropped"]), step
    pairs = zip(report["steps"], report["steps"][1:], strict=False)
    assert all(a["rows_out"] == b["rows_in"] for a, b in pairs)
    return {s["name"]: set(s["dropped"]) for s in report["steps"] if s["dropped"]}


def harmless_patch(row: dict[str, Any]) -> str:
    """A patch that applies to the row's base and changes nothing the tests look at."""
    module = next(p for p in row["files"] if not p.startswith("test_"))
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        git(repo, "init", "-q", "-b", "main")
        commit_tree(repo, row["files"], "base")
        (repo / module).write_text(row["files"][module] + "\n# reviewed\n")
        return git(repo, "diff", "--full-index")


def corrupt(patch: str) -> str:
    """The patch with its first removed line changed, so its context no longer matches."""
    lines = patch.split("\n")
    i = next(i for i, ln in enumerate(lines) if ln.startswith("-") and not ln.startswith("---"))
    lines[i] = "-#" + lines[i][1:]
    return "\n".join(lines)


def bench_file(tmp_path: Path) -> tuple[Path, Path, set[str], dict[str, set[str]]]:
    """Good shipped rows and one or more planted rows per filter; (file, eval set, good, planted)."""
    shipped = [dict(t.to_row(), image=f"humaneval:{i}") for i, t in enumerate(load_shipped())]
    good = shipped[:5]
    good[0]["created_at"] = "2021-06-01T00:00:00Z"
    good[3]["meta"] = {k: v for k, v in good[3]["meta"].items() if k != "license"}  # kept: unknown
    base = good[2]

    def copy(iid: str, source: dict[str, Any] = base, **over: Any) -> dict[str, Any]:
        return {**source, "instance_id": iid, **over}

    missing_patch = copy("no-patch")
    del missing_patch["patch"]
    f2p_moved = copy("bad-f2p", shipped[8])
    f2p_moved["FAIL_TO_PASS"] = [*f2p_moved["FAIL_TO_PASS"], f2p_moved["PASS_TO_PASS"][0]]
    f2p_moved["PASS_TO_PASS"] = f2p_moved["PASS_TO_PASS"][1:]
    gold_broken = copy("gold-does-not-apply", shipped[6])
    gold_broken["patch"] = corrupt(gold_broken["patch"])
    reworded = good[1]["problem_statement"].replace("does not do", "fails to do", 1)
    planted_rows = {
        "schema": ["{this is not json", missing_patch, copy(good[0]["instance_id"]),
                   copy("bad-list", FAIL_TO_PASS="test_x.py::test_a")],
        "statement": [copy("too-short", problem_statement="Fix the bug.")],
        "source": [copy("no-image", image="")],
        "tests": [copy("no-f2p", FAIL_TO_PASS=[]),
                  copy("in-both", PASS_TO_PASS=[*base["PASS_TO_PASS"], base["FAIL_TO_PASS"][0]]),
                  copy("too-many", PASS_TO_PASS=[f"test_x.py::test_{i}" for i in range(201)])],
        "license": [copy("gpl", meta={**base["meta"], "license": "GPL-3.0-only"})],
        "decontaminate": [copy("acme__widgets-17"),
                          copy("too-new", created_at="2024-02-01T08:00:00Z")],
        "dedup": [copy("reworded-duplicate", good[1], problem_statement=reworded)],
        "gold": [gold_broken,
                 copy("gold-does-not-pass", shipped[7], patch=harmless_patch(shipped[7]))],
        "f2p": [f2p_moved],
    }  # fmt: skip
    rows: list[Any] = [*good]
    for plants in planted_rows.values():
        rows[2:2] = plants  # among the good rows, after the one the duplicate copies
    path = write_lines(tmp_path / "bench.jsonl", rows)
    evals = write_lines(tmp_path / "eval.jsonl", [{"instance_id": "acme__widgets-17"}])
    line = {id(r): n for n, r in enumerate(rows, start=1)}
    planted = {step: {f"line {line[id(r)]}" if step == "schema" else r["instance_id"] for r in rs}
               for step, rs in planted_rows.items()}  # fmt: skip
    return path, evals, {r["instance_id"] for r in good}, planted


def test_swe_bench_like_file_loses_exactly_its_planted_rows(tmp_path):
    path, evals, good, planted = bench_file(tmp_path)
    out = tmp_path / "out" / "clean.jsonl"
    config = CleanConfig(
        input=str(path), output=str(out), dropped=str(tmp_path / "dropped.jsonl"), workers=2,
        license=LicenseFilter(allow=("mit",)),  # SPDX ids match case-insensitively
        decontaminate=DecontaminateFilter(eval_set=str(evals), created_after="2023-12-31"),
        source=SourceFilter(require_image=True),
        grade=grading(tmp_path),
    )  # fmt: skip
    report = clean(config)
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["instance_id"] for r in kept} == good
    assert out.read_text().splitlines() == [r.text for r in report.kept]  # rows as read
    assert dropped_by_step(Path(f"{out}.report.json")) == planted
    dropped = [json.loads(line) for line in (tmp_path / "dropped.jsonl").read_text().splitlines()]
    assert len(dropped) == sum(len(v) for v in planted.values())
    reasons = {d["instance_id"]: d["reason"] for d in dropped}
    assert "passes without the fix" in reasons["bad-f2p"]
    assert "near-duplicates" in reasons["reworded-duplicate"] and good & {
        reasons["reworded-duplicate"].split("'")[1]
    }  # the earlier original is the one kept
    assert "does not pass" in reasons["gold-does-not-pass"]
    assert "does not apply" in reasons["gold-does-not-apply"]
    schema = [d for d in dropped if d["step"] == "schema"]
    assert any("missing required field 'patch'" in d["reason"] for d in schema)
    assert any("'FAIL_TO_PASS'" in d["reason"] for d in schema)


CALC = {  # the clean repository; each bug breaks one function, whose test file the branch hides
    "add": ("def add(a, b):\n    return a + b\n", "add(2, 3) == 5"),
    "mul": ("def mul(a, b):\n    return a * b\n", "mul(2, 3) == 6"),
    "neg": ("def neg(a):\n    return -a\n", "neg(4) == -4"),
    "half": ("def half(a):\n    return a // 2\n", "half(9) == 4"),
}
SMITH_BUGS = {  # branch suffix → (function, buggy body line, problem statement)
    "func_pm_op_swap__a1": ("add", "return a - b", "add(2, 3) returns -1 where the sum 5 is expected"),
    "func_pm_op_change__b2": ("mul", "return a + b", "mul(2, 3) gives 5, but multiplying two and three is 6"),
    "func_pm_remove_neg__c3": ("neg", "return a", "neg(4) hands back 4 unchanged instead of its negation"),
    "pr_17": ("half", "return a / 2", "half(9) is 4.5 since PR 17; integer halving is expected"),
    "func_pm_floor__d4": ("half", "return a / 2", "half of an odd number is a float, not floored"),
    "lm_modify__e5": ("mul", "return a * b + 0 * a", "mul keeps working but the tests were never broken"),
}  # fmt: skip


def smith_mirror(tmp_path: Path) -> Path:
    """SWE-smith's layout: a clean main; per bug a branch of Bug Patch, then Remove F2P Tests."""
    mirrors = tmp_path / "mirrors"
    mirror = mirrors / SMITH_REPO.replace("/", "__")
    mirror.mkdir(parents=True)
    git(mirror, "init", "-q", "-b", "main")
    files = {f"calc/{fn}.py": src for fn, (src, _) in CALC.items()}
    files["calc/__init__.py"] = ""
    for fn, (_, check) in CALC.items():
        files[f"tests/test_{fn}.py"] = (
            f"from calc.{fn} import {fn}\n\n\ndef test_{fn}():\n    assert {check}\n"
        )
    commit_tree(mirror, files, "clean")
    for suffix, (fn, line, _) in SMITH_BUGS.items():
        git(mirror, "checkout", "-q", "-b", f"{SMITH_PREFIX}.{suffix}", "main")
        src = CALC[fn][0]
        (mirror / f"calc/{fn}.py").write_text(src.replace(src.splitlines()[1].strip(), line))
        git(mirror, "commit", "-q", "-am", "Bug Patch")
        git(mirror, "rm", "-q", f"tests/test_{fn}.py")
        git(mirror, "commit", "-q", "-m", "Remove F2P Tests")
    git(mirror, "checkout", "-q", "main")
    return mirrors


def smith_row(suffix: str, iid: str = "", **over: Any) -> dict[str, Any]:
    """A row of the bug on branch `suffix`; with `iid`, another instance naming that branch."""
    fn, line, statement = SMITH_BUGS.get(suffix, ("add", "return a - b", f"{suffix} is broken"))
    src = CALC[fn][0]
    bug = src.replace(src.splitlines()[1].strip(), line)
    patch = (
        f"diff --git a/calc/{fn}.py b/calc/{fn}.py\n--- a/calc/{fn}.py\n+++ b/calc/{fn}.py\n"
        f"@@ -1,2 +1,2 @@\n {src.splitlines()[0]}\n-{src.splitlines()[1]}\n+{bug.splitlines()[1]}\n"
    )
    others = [f"tests/test_{g}.py::test_{g}" for g in CALC if g != fn]
    row = {
        "instance_id": f"{SMITH_PREFIX}.{iid or suffix}",
        "repo": SMITH_REPO,
        **({"branch": f"{SMITH_PREFIX}.{suffix}"} if iid else {}),
        "patch": patch,
        "FAIL_TO_PASS": [f"tests/test_{fn}.py::test_{fn}"],
        "PASS_TO_PASS": others,
        "image_name": "jyangballin/swesmith.x86_64.acme_1776_calc.1234abcd",
        "problem_statement": statement,
    }
    row.update(over)
    return row


def test_swe_smith_like_file_loses_exactly_its_planted_rows(tmp_path, capsys):
    mirrors = smith_mirror(tmp_path)
    good = [smith_row(s) for s in ("func_pm_op_swap__a1", "func_pm_op_change__b2",
                                   "func_pm_remove_neg__c3")]  # fmt: skip
    no_repo = smith_row("func_pm_floor__d4", "schema")
    del no_repo["repo"]
    neg = SMITH_BUGS["func_pm_remove_neg__c3"][2]
    many = [f"tests/test_x.py::test_{i}" for i in range(9)]
    floor = smith_row("func_pm_floor__d4")
    planted_rows = {
        "schema": [no_repo],
        "statement": [smith_row("func_pm_floor__d4", problem_statement="")],  # SWE-smith's default
        "source": [smith_row("func_pm_gone__zz", problem_statement=floor["problem_statement"])],
        "tests": [smith_row("lm_modify__e5", "many", PASS_TO_PASS=many)],
        "decontaminate": [smith_row("pr_17")],  # mirrors PR 17, which the eval set holds
        "dedup": [smith_row("func_pm_floor__d4", "dup", problem_statement=neg + " Thanks!")],
        # The row's bug patch is not the branch's: its reverse does not apply at the tip.
        "gold": [
            smith_row(
                "lm_modify__e5",
                "wrong-patch",
                patch=floor["patch"],
                problem_statement=floor["problem_statement"],
            )
        ],
        # Its "bug" breaks nothing: the FAIL_TO_PASS test passes at the tip already.
        "f2p": [smith_row("lm_modify__e5")],
    }
    rows = [*good, *[r for rs in planted_rows.values() for r in rs]]
    path = write_lines(tmp_path / "smith.jsonl", rows)
    evals = write_lines(tmp_path / "verified.jsonl", [{"instance_id": "acme__calc-17",
                                                       "repo": "acme/calc"}])  # fmt: skip
    out = tmp_path / "smith.clean.jsonl"
    assert main([str(path), str(out), f"--mirrors={mirrors}", f"--root={tmp_path / 'sandboxes'}",
                 "--max-tests=8", f"--eval-set={evals}", "--plugin-autoload=false"]) == 0  # fmt: skip
    kept = [json.loads(line)["instance_id"] for line in out.read_text().splitlines()]
    assert kept == [r["instance_id"] for r in good]
    line = {id(r): n for n, r in enumerate(rows, start=1)}
    planted = {step: {f"line {line[id(r)]}" if step == "schema" else r["instance_id"] for r in rs}
               for step, rs in planted_rows.items()}  # fmt: skip
    assert dropped_by_step(Path(f"{out}.report.json")) == planted
    printed = capsys.readouterr().out.splitlines()  # the table says what the JSON says
    for step in json.loads(Path(f"{out}.report.json").read_text())["steps"]:
        counts = [str(step[k]) for k in ("rows_in", "rows_out")] + [str(len(step["dropped"]))]
        assert any(ln.split()[:4] == [step["name"], *counts] for ln in printed), step["name"]
