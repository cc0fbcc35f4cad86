"""Rollouts: tasks, launchers that run harness processes, evaluators that score them."""

from harnessrl.rollout.tasks import Launcher, RunResult, RunSpec, Task, load_tasks, save_tasks

__all__ = ["Launcher", "RunResult", "RunSpec", "Task", "load_tasks", "save_tasks"]
