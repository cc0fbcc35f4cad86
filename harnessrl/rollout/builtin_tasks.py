"""The built-in task set: small additions a 135M model gets right only sometimes.

In: a seed and split sizes. Out: deterministic, disjoint train and held-out eval task lists
for the `exact_number` evaluator (`save_tasks` writes them as JSONL).
"""

from __future__ import annotations

import random

from harnessrl.rollout.tasks import Task

PROMPT = "What is {a}+{b}? Answer with just the number."


def addition_tasks(
    n_train: int, n_eval: int, seed: int = 0, lo: int = 1, hi: int = 20
) -> tuple[list[Task], list[Task]]:
    """Sums a+b with a, b in [lo, hi]; the eval split shares no (a, b) pair with train."""
    if lo > hi:
        raise ValueError(f"addition_tasks: lo={lo} must be <= hi={hi}")
    if n_train < 1 or n_eval < 1:
        raise ValueError(f"addition_tasks: n_train={n_train} and n_eval={n_eval} must be >= 1")
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    if n_train + n_eval > len(pairs):
        raise ValueError(
            f"addition_tasks: {n_train}+{n_eval} tasks requested but only {len(pairs)} distinct "
            f"pairs exist in [{lo}, {hi}]; widen the range or ask for fewer"
        )
    random.Random(seed).shuffle(pairs)
    tasks = [
        Task(
            task_id=f"add-{a}-{b}",
            prompt=PROMPT.format(a=a, b=b),
            answer=str(a + b),
            meta={"a": a, "b": b},
        )
        for a, b in pairs[: n_train + n_eval]
    ]
    # Eval first so that growing n_train never changes which tasks are held out.
    return tasks[n_eval:], tasks[:n_eval]
