"""Rollouts: tasks, rounds of harness runs, the launchers that run them, evaluators that score them.

Coding tasks run their harness in a sandbox per run (`CodingLauncher`) and are graded from the
diff it leaves (`CodingEvaluator`).

The names the train loop uses are importable from here; the Kubernetes launcher stays in
`harnessrl.rollout.k8s`, imported only by runs that use it.
"""

from harnessrl.rollout.builtin_tasks import addition_tasks
from harnessrl.rollout.coding import (
    CodingEvaluator,
    CodingLauncher,
    coding_metrics,
    coding_task_sets,
    is_coding,
)
from harnessrl.rollout.evaluators import Evaluate, Evaluation, get_evaluator
from harnessrl.rollout.local import LocalLauncher, parse_command
from harnessrl.rollout.round import RoundResult, plan_round, run_round, sample_tasks
from harnessrl.rollout.tasks import Launcher, RunResult, RunSpec, Task, load_tasks, save_tasks

__all__ = [
    "CodingEvaluator",
    "CodingLauncher",
    "Evaluate",
    "Evaluation",
    "Launcher",
    "LocalLauncher",
    "RoundResult",
    "RunResult",
    "RunSpec",
    "Task",
    "addition_tasks",
    "coding_metrics",
    "coding_task_sets",
    "get_evaluator",
    "is_coding",
    "load_tasks",
    "parse_command",
    "plan_round",
    "run_round",
    "sample_tasks",
    "save_tasks",
]
