"""Shared launcher records: a task, how to run it once, and what came out.

In: JSONL task sets and the train loop's run plan. Out: `Task`, `RunSpec`, `RunResult` and the
`Launcher` protocol that the local and Kubernetes launchers implement.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from harnessrl.traces.schema import RolloutState


@dataclass(frozen=True)
class Task:
    """One problem a harness is asked to solve; `answer` is what programmatic evaluators check."""

    task_id: str
    prompt: str
    answer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.task_id, str) or not self.task_id:
            raise ValueError(f"Task.task_id must be a non-empty string, got {self.task_id!r}")
        if not isinstance(self.prompt, str):
            raise TypeError(f"Task.prompt must be a string, got {type(self.prompt).__name__}")
        if self.answer is not None and not isinstance(self.answer, str):
            raise TypeError(
                f"Task.answer must be a string or None, got {type(self.answer).__name__} "
                f"({self.answer!r}); quote numbers in the task file"
            )
        if not isinstance(self.meta, dict):
            raise TypeError(f"Task.meta must be a dict, got {type(self.meta).__name__}")

    def to_json(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "prompt": self.prompt,
            "answer": self.answer,
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Task:
        if not isinstance(obj, dict):
            raise TypeError(f"a task must be a JSON object, got {type(obj).__name__}")
        unknown = set(obj) - {"task_id", "prompt", "answer", "meta"}
        if unknown:
            raise ValueError(
                f"unknown task field(s) {sorted(unknown)}; allowed: task_id, prompt, answer, meta"
            )
        missing = {"task_id", "prompt"} - set(obj)
        if missing:
            raise ValueError(f"task is missing required field(s) {sorted(missing)}: {obj!r}")
        return cls(
            task_id=obj["task_id"],
            prompt=obj["prompt"],
            answer=obj.get("answer"),
            meta=dict(obj.get("meta") or {}),
        )


@dataclass(frozen=True)
class RunSpec:
    """One harness run of one task: the k runs of a task in a step share `group_id`."""

    rollout_id: str
    task: Task
    group_id: str
    attempt: int
    base_url: str  # the harness's OPENAI_BASE_URL (the sidecar's per-rollout path)
    timeout_s: float
    # Where and with what the harness may post its own reward (HARNESSRL_REWARD_URL/_TOKEN);
    # empty: not offered. The token is good for this rollout's reward only.
    reward_url: str = ""
    reward_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not self.rollout_id or "/" in self.rollout_id:
            raise ValueError(
                f"RunSpec.rollout_id must be non-empty and contain no '/', got {self.rollout_id!r}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"RunSpec.timeout_s must be > 0, got {self.timeout_s!r}")


@dataclass(frozen=True)
class RunResult:
    """What a finished run left behind; `output` is the harness's final answer (its stdout, or
    what its launcher took of its work, such as the diff of a checkout)."""

    rollout_id: str
    state: RolloutState
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    output: str
    info: dict[str, Any] = field(default_factory=dict)  # the launcher's details, for the record


class Launcher(Protocol):
    """Runs harness processes; never raises for a failed run (it becomes a FAILED/TIMED_OUT result)."""

    def run(self, specs: list[RunSpec]) -> list[RunResult]:
        """Run all specs (at most the launcher's concurrency limit at once); results in spec order."""
        ...


def load_tasks(path: str | Path) -> list[Task]:
    """Read a JSONL task set (one task object per line, blank lines ignored)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"task file {str(p)!r} does not exist; generate one or fix the path")
    tasks: list[Task] = []
    seen: set[str] = set()
    for lineno, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{lineno}: not valid JSON ({e.msg})") from e
        try:
            task = Task.from_json(obj)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{p}:{lineno}: {e}") from e
        if task.task_id in seen:
            raise ValueError(f"{p}:{lineno}: duplicate task_id {task.task_id!r}")
        seen.add(task.task_id)
        tasks.append(task)
    if not tasks:
        raise ValueError(f"task file {str(p)!r} holds no tasks")
    return tasks


def save_tasks(tasks: Iterable[Task], path: str | Path) -> Path:
    """Write tasks as JSONL (atomically: a crash never leaves a half-written task set)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    with tmp.open("w") as f:
        for t in tasks:
            f.write(json.dumps(t.to_json(), sort_keys=True) + "\n")
    tmp.replace(p)
    return p
