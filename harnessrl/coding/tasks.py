"""Coding tasks: SWE-bench rows, SWE-smith rows and task folders, read into one frozen record.

In: JSONL files (one row per line) or a folder per task. Out: `CodingTask`s; a malformed row is a
ValueError naming the file, the line (or folder), the instance and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harnessrl.coding.patches import reverse_patch

KINDS = ("swe-bench", "swe-smith")


@dataclass(frozen=True)
class CodingTask:
    """One repository-level task.

    `patch` is always the gold fix, applied forward to the base (a SWE-smith row's bug-creating
    patch is stored reversed). The base tree is either `files` (an inline task, built into a git
    repository on demand) or `repo` at `base_commit` (or, for SWE-smith, the tip of `branch`).
    """

    instance_id: str
    problem_statement: str
    patch: str
    test_patch: str = ""
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    repo: str = ""
    base_commit: str = ""
    branch: str = ""
    files: tuple[tuple[str, str], ...] = ()
    setup: str = ""  # shell lines run in the checkout before tests (no network in the grader)
    image: str = ""  # the task's container image, where the row names one
    eval_script: str = ""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("instance_id", "problem_statement", "patch", "test_patch", "repo",
                     "base_commit", "branch", "setup", "image", "eval_script"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"CodingTask.{name} must be a string, got {type(value).__name__}")
        if not self.instance_id or "/" in self.instance_id or self.instance_id.startswith("."):
            raise ValueError(
                f"CodingTask.instance_id must be non-empty, without '/' and not start with '.', "
                f"got {self.instance_id!r}"
            )
        for name in ("fail_to_pass", "pass_to_pass"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple) or not all(isinstance(t, str) and t for t in ids):
                raise TypeError(f"CodingTask.{name} must be a tuple of non-empty strings: {ids!r}")
        if self.files:
            if not all(isinstance(p, str) and isinstance(t, str) for p, t in self.files):
                raise TypeError("CodingTask.files must be (path, text) pairs of strings")
            for path, _ in self.files:
                parts = Path(path).parts
                if not parts or Path(path).is_absolute() or ".." in parts or parts[0] == ".git":
                    raise ValueError(f"CodingTask.files: path {path!r} must stay inside the repo")
        elif not self.repo:
            raise ValueError(f"task {self.instance_id!r} has neither files nor a repo")
        elif not (self.base_commit or self.branch):
            raise ValueError(f"task {self.instance_id!r} needs a base_commit or a branch")

    @property
    def kind(self) -> str:
        """'inline' (files), 'swe-smith' (a branch per task) or 'swe-bench' (repo at a commit)."""
        if self.files:
            return "inline"
        return "swe-smith" if self.branch and not self.base_commit else "swe-bench"

    def to_row(self) -> dict[str, Any]:
        """A SWE-bench-shaped row (plus `files`/`branch`/`setup` where set) that reads back equal."""
        row: dict[str, Any] = {
            "instance_id": self.instance_id,
            "repo": self.repo,
            "base_commit": self.base_commit,
            "problem_statement": self.problem_statement,
            "patch": self.patch,
            "test_patch": self.test_patch,
            "FAIL_TO_PASS": list(self.fail_to_pass),
            "PASS_TO_PASS": list(self.pass_to_pass),
        }
        for name in ("branch", "setup", "image", "eval_script"):
            if getattr(self, name):
                row[name] = getattr(self, name)
        if self.files:
            row["files"] = dict(self.files)
        if self.meta:
            row["meta"] = self.meta
        return row


class RowError(ValueError):
    """A task row that cannot be read; the message names where and which field."""


def _field(row: dict[str, Any], name: str, where: str, *, default: str | None = None) -> str:
    if name not in row or row[name] is None:
        if default is None:
            raise RowError(f"{where}: missing required field {name!r}")
        return default
    value = row[name]
    if not isinstance(value, str):
        raise RowError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    return value


def _test_ids(row: dict[str, Any], name: str, where: str) -> tuple[str, ...]:
    """A test list: a JSON list, or (as in SWE-bench's own files) a string holding one."""
    value = row.get(name, [])
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as err:
            raise RowError(
                f"{where}: field {name!r} is a string but not a JSON list: {err}"
            ) from err
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise RowError(f"{where}: field {name!r} must be a list of non-empty test ids: {value!r}")
    return tuple(value)


def _files(row: dict[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    files = row.get("files") or {}
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise RowError(f"{where}: field 'files' must map paths to file text")
    return tuple(sorted(files.items()))


META_SKIP = {"instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch",
             "FAIL_TO_PASS", "PASS_TO_PASS", "files", "branch", "setup", "image", "image_name",
             "eval_script", "meta"}  # fmt: skip


def task_from_row(row: Any, *, where: str, kind: str = "auto") -> CodingTask:
    """One SWE-bench or SWE-smith row (`kind` 'auto' tells them apart by `test_patch`)."""
    if not isinstance(row, dict):
        raise RowError(f"{where}: a task row must be a JSON object, got {type(row).__name__}")
    instance = _field(row, "instance_id", where)
    where = f"{where} (instance {instance!r})"
    if kind == "auto":
        kind = "swe-bench" if "test_patch" in row or "files" in row else "swe-smith"
    if kind not in KINDS:
        raise ValueError(f"kind must be 'auto' or one of {KINDS}, got {kind!r}")
    meta = {k: v for k, v in row.items() if k not in META_SKIP}
    if isinstance(row.get("meta"), dict):
        meta.update(row["meta"])
    files = _files(row, where)
    common = dict(
        instance_id=instance,
        problem_statement=_field(row, "problem_statement", where, default="" if kind == "swe-smith" else None),
        fail_to_pass=_test_ids(row, "FAIL_TO_PASS", where),
        pass_to_pass=_test_ids(row, "PASS_TO_PASS", where),
        image=_field(row, "image", where, default="") or _field(row, "image_name", where, default=""),
        eval_script=_field(row, "eval_script", where, default=""),
        setup=_field(row, "setup", where, default=""),
        meta=meta,
    )  # fmt: skip
    try:
        if kind == "swe-smith":
            # The row's patch plants the bug in the clean repo; the task's fix undoes it.
            return CodingTask(
                patch=reverse_patch(_field(row, "patch", where)),
                test_patch=_field(row, "test_patch", where, default=""),
                repo=_field(row, "repo", where),
                branch=_field(row, "branch", where, default="") or instance,
                **common,  # type: ignore[arg-type]
            )
        branch = _field(row, "branch", where, default="")
        return CodingTask(
            patch=_field(row, "patch", where),
            test_patch=_field(row, "test_patch", where),
            repo=_field(row, "repo", where, default="" if files else None),
            base_commit=_field(row, "base_commit", where, default="" if files or branch else None),
            branch=branch,
            files=files,
            **common,  # type: ignore[arg-type]
        )
    except (TypeError, ValueError) as err:
        if isinstance(err, RowError):
            raise
        raise RowError(f"{where}: {err}") from err


def read_jsonl(path: str | Path, *, kind: str = "auto") -> list[CodingTask]:
    """Every row of a JSONL task file; blank lines are skipped, instance ids must be unique."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"task file {str(p)!r} does not exist")
    tasks: list[CodingTask] = []
    seen: dict[str, int] = {}
    # Lines end at "\n" only: JSON text may hold a raw U+2028 or U+0085, which splitlines() splits.
    for lineno, line in enumerate(p.read_text().split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{p}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise RowError(f"{where}: not valid JSON ({err})") from err
        task = task_from_row(row, where=where, kind=kind)
        if task.instance_id in seen:
            raise RowError(
                f"{where}: instance {task.instance_id!r} already on line {seen[task.instance_id]}"
            )
        seen[task.instance_id] = lineno
        tasks.append(task)
    return tasks


def write_jsonl(tasks: list[CodingTask], path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(t.to_row(), sort_keys=True) + "\n" for t in tasks))


# A task folder: the files below, plus repo/ (the base tree) when task.json names no repo.
DIR_FILES = {
    "problem_statement": "problem_statement.md",
    "patch": "gold.patch",
    "test_patch": "test.patch",
    "setup": "setup.sh",
    "eval_script": "eval.sh",
}


def read_task_dir(path: str | Path) -> CodingTask:
    """One task folder (see docs/coding.md for the layout)."""
    d = Path(path)
    where = f"task folder {str(d)!r}"
    if not (d / "problem_statement.md").is_file():
        raise RowError(f"{where}: missing problem_statement.md")
    try:
        row: dict[str, Any] = (
            json.loads((d / "task.json").read_text()) if (d / "task.json").is_file() else {}
        )
        tests = json.loads((d / "tests.json").read_text()) if (d / "tests.json").is_file() else None
    except json.JSONDecodeError as err:
        raise RowError(f"{where}: task.json or tests.json is not valid JSON ({err})") from err
    if not isinstance(row, dict) or not isinstance(tests, dict):
        raise RowError(f"{where}: needs tests.json with FAIL_TO_PASS and PASS_TO_PASS (objects)")
    row.setdefault("instance_id", d.name)
    row.update({k: tests.get(k, []) for k in ("FAIL_TO_PASS", "PASS_TO_PASS")})
    for name, filename in DIR_FILES.items():
        if (d / filename).is_file():
            row[name] = (d / filename).read_text()
    if "patch" not in row:
        raise RowError(f"{where}: missing gold.patch")
    row.setdefault("test_patch", "")
    base = d / "repo"
    if base.is_dir():
        row["files"] = {
            f.relative_to(base).as_posix(): f.read_text()
            for f in sorted(base.rglob("*"))
            if f.is_file() and ".git" not in f.relative_to(base).parts
        }
    # gold.patch is the fix in every folder, so the row reads as SWE-bench-shaped (never reversed).
    return task_from_row(row, where=where, kind="swe-bench")


def write_task_dir(task: CodingTask, root: str | Path) -> Path:
    """Write `task` as a folder under `root`; `read_task_dir` reads it back equal."""
    d = Path(root) / task.instance_id
    d.mkdir(parents=True)
    row = task.to_row()
    for name, filename in DIR_FILES.items():
        text = row.pop(name, "")
        if text or name in ("problem_statement", "patch"):
            (d / filename).write_text(text)
    tests = {k: row.pop(k) for k in ("FAIL_TO_PASS", "PASS_TO_PASS")}
    (d / "tests.json").write_text(json.dumps(tests, indent=1) + "\n")
    for rel, text in row.pop("files", {}).items():
        (d / "repo" / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / "repo" / rel).write_text(text)
    (d / "task.json").write_text(json.dumps(row, indent=1, sort_keys=True) + "\n")
    return d


def load_tasks(path: str | Path, *, kind: str = "auto") -> list[CodingTask]:
    """A JSONL file, one task folder, or a folder of task folders."""
    p = Path(path)
    if p.is_file():
        return read_jsonl(p, kind=kind)
    if (p / "problem_statement.md").is_file():
        return [read_task_dir(p)]
    if p.is_dir():
        return [read_task_dir(d) for d in sorted(p.iterdir()) if d.is_dir()]
    raise ValueError(f"tasks path {str(p)!r} is neither a JSONL file nor a folder")
