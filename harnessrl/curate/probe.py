"""Pass@k probing: k runs of the current policy per task through the trainer's own rollout round.

In: coding tasks, k, and the trainer's settings (policy, servers, sidecar, harness, grader). Out:
each task's k rewards (None for a run that failed or was never graded), and the tasks the passk
step drops: always solved, never graded, and all but a share of the never solved.
"""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from harnessrl.coding.tasks import CodingTask

if TYPE_CHECKING:  # the trainer (and jax) load only when a probe runs
    from harnessrl.config import TrainConfig

# Each task's rewards over its probing runs, by instance id; None where no grade was made.
Probe = Callable[[Sequence[CodingTask], int], dict[str, list[float | None]]]


@dataclass(frozen=True)
class PassKFilter:
    """passk: k runs of the current policy per task; keep mixed outcomes, some all-fail ones."""

    k: int = 0  # runs per task; 0: the step is off
    keep_all_fail: float = 0.0  # share of the never-solved tasks kept (chosen by seed)
    seed: int = 0
    # The trainer's YAML (the policy in serve.model or rollout.servers, the harness in
    # rollout.coding): the runs are made as `python -m harnessrl.train` would make them.
    train_config: str = ""
    train_set: tuple[str, ...] = ()  # more trainer settings, key=value (e.g. serve.model=tiny)
    out_dir: str = ""  # the probe's trace store and sidecar log; "": OUT.passk beside the output

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"k must be >= 0, got {self.k!r}")
        if not 0.0 <= self.keep_all_fail <= 1.0:
            raise ValueError(f"keep_all_fail must be in [0, 1], got {self.keep_all_fail!r}")


def select_passk(
    rewards: dict[str, list[float | None]], tasks: Sequence[CodingTask], config: PassKFilter
) -> dict[int, str]:
    """Index → reason for each task to drop: runs that agree leave GRPO nothing to learn."""
    out: dict[int, str] = {}
    all_fail: list[int] = []
    for i, task in enumerate(tasks):
        graded = [r for r in rewards.get(task.instance_id, []) if r is not None]
        if not graded:
            out[i] = f"none of its {config.k} probing runs was graded"
        elif len(set(graded)) > 1:
            continue
        elif graded[0] == 0.0:
            all_fail.append(i)
        else:
            out[i] = f"reward {graded[0]} in all {len(graded)} graded runs: nothing to learn"

    def rank(i: int) -> bytes:  # a seeded order that does not depend on the file's order
        return hashlib.sha256(f"{config.seed}:{tasks[i].instance_id}".encode()).digest()

    keep = set(sorted(all_fail, key=rank)[: round(config.keep_all_fail * len(all_fail))])
    for i in all_fail:
        if i not in keep:
            out[i] = f"failed all {config.k} probing runs (keep_all_fail={config.keep_all_fail})"
    return out


def loop_probe(config: PassKFilter, tasks_file: str, out_dir: Path) -> Probe:
    """A probe that plays one round of the train loop: its policy, sidecar, harness and grader.

    The trainer's settings are read as for `python -m harnessrl.train rollout.tasks=coding:FILE`
    (so the coding presets apply), then `train_config` and `train_set` on top.
    """

    def probe(tasks: Sequence[CodingTask], k: int) -> dict[str, list[float | None]]:
        from harnessrl.config import load_config

        settings = [f"rollout.tasks=coding:{tasks_file}", *config.train_set]
        cfg = load_config(config.train_config or None, settings)
        return play_round(cfg, tasks, k, out_dir)

    return probe


def play_round(
    cfg: TrainConfig, tasks: Sequence[CodingTask], k: int, out: Path
) -> dict[str, list[float | None]]:
    """k runs of each task, made and graded as the train loop makes them; rewards by task."""
    from harnessrl.coding.rollouts import as_task
    from harnessrl.model.formats.load import load_policy
    from harnessrl.rollout import plan_round, run_round
    from harnessrl.stack import Stack

    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, evaluator="coding"))
    out.mkdir(parents=True, exist_ok=True)
    stack = Stack(cfg, {t.instance_id: t for t in tasks}, out)
    model, tokenizer = load_policy(cfg.serve.model, seed=cfg.run.seed)
    stack.start(model, tokenizer)
    try:
        specs = plan_round(
            [as_task(t) for t in tasks], prefix=f"passk-{uuid.uuid4().hex[:6]}",
            runs_per_task=k, base_url=stack.capture.base_url, timeout_s=cfg.rollout.timeout_s,
            reward=stack.capture.reward_credential,
        )  # fmt: skip
        workers = cfg.rollout.coding.grade_workers
        result = run_round(
            specs, stack.launcher, stack.store, stack.evaluate, cfg.rollout.posted_reward, workers
        )
    finally:
        stack.stop()
    rewards: dict[str, list[float | None]] = {t.instance_id: [] for t in tasks}
    for spec in specs:  # a failed or ungraded run has no reward: None, never a 0
        rewards[spec.task.task_id].append(result.rewards.get(spec.rollout_id))
    return rewards
