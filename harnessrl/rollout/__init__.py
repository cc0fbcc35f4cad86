"""Rollouts: tasks, rounds of harness runs, the launchers that run them, evaluators that score them.

The names the train loop uses are importable from here.
"""

from harnessrl.rollout.builtin_tasks import addition_tasks
from harnessrl.rollout.evaluators import Evaluate, Evaluation, get_evaluator
from harnessrl.rollout.local import LocalLauncher, parse_command
from harnessrl.rollout.round import RoundResult, plan_round, run_round, sample_tasks
from harnessrl.rollout.tasks import Launcher, RunResult, RunSpec, Task, load_tasks, save_tasks

__all__ = [
    "Evaluate",
    "Evaluation",
    "Launcher",
    "LocalLauncher",
    "RoundResult",
    "RunResult",
    "RunSpec",
    "Task",
    "addition_tasks",
    "get_evaluator",
    "load_tasks",
    "parse_command",
    "plan_round",
    "run_round",
    "sample_tasks",
    "save_tasks",
]
