"""Per-run advantages from rewards, relative to the other runs of the same task in the step.

In: the step's `RolloutRecord`s (state, reward, group_id). Out: one advantage per training run
(broadcast later to all of that run's sequences) and the reason every other run was left out.
"""

from __future__ import annotations

import enum
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from harnessrl.traces.schema import RolloutRecord, RolloutState


class Estimator(enum.StrEnum):
    GRPO = "grpo"  # (r - mean) / std of the group (std division optional)
    RLOO = "rloo"  # r - mean of the *other* runs of the group
    DR_GRPO = "dr_grpo"  # r - mean, never divided by std (pair with the `constant` loss mode)


@dataclass
class AdvantageResult:
    advantages: dict[str, float]  # rollout_id -> advantage, only runs that train this step
    rewards: dict[str, float]  # rollout_id -> reward used, for the same runs
    excluded: dict[str, str] = field(default_factory=dict)  # rollout_id -> why it is left out


def _reward_of(
    run: RolloutRecord, include_failed: bool, failed_reward: float | None
) -> tuple[float | None, str | None]:
    """The reward a run trains with, or the reason it does not train."""
    if run.state in (RolloutState.QUEUED, RolloutState.RUNNING):
        return None, "not_finished"
    if run.state != RolloutState.SUCCEEDED:
        if not include_failed:
            return None, str(run.state)
        if run.reward is not None:
            return float(run.reward), None
        if failed_reward is None:
            raise ValueError(
                f"run {run.rollout_id!r} is {run.state} without a reward and include_failed=True; "
                "set failed_reward to the reward such runs should train with"
            )
        return float(failed_reward), None
    if run.reward is None:
        return None, "no_reward"
    return float(run.reward), None


def _group_advantages(
    r: np.ndarray, estimator: Estimator, std_normalize: bool, eps: float
) -> np.ndarray:
    n = r.size
    centered: np.ndarray = r - float(r.mean())
    if estimator == Estimator.RLOO:
        # r_i - mean_{j != i} r_j == n/(n-1) * (r_i - mean); a lone run has no baseline.
        return np.asarray(centered * (n / (n - 1)) if n > 1 else np.zeros_like(r))
    if estimator == Estimator.GRPO and std_normalize:
        return np.asarray(centered / (float(r.std()) + eps))
    return centered


def compute_advantages(
    rollouts: Iterable[RolloutRecord],
    *,
    estimator: Estimator | str = Estimator.GRPO,
    std_normalize: bool = True,
    eps: float = 1e-6,
    drop_zero_variance: bool = True,
    include_failed: bool = False,
    failed_reward: float | None = None,
) -> AdvantageResult:
    """Group runs by `group_id` (any group size) and compute each run's advantage.

    Failed or timed-out runs are excluded unless `include_failed`; then they train with their
    reward, or `failed_reward` when they have none. A run is never trained as reward 0 by accident.
    """
    try:
        est = Estimator(estimator)
    except ValueError as err:
        choices = [e.value for e in Estimator]
        raise ValueError(f"estimator must be one of {choices}, got {estimator!r}") from err
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    groups: dict[str, list[tuple[str, float]]] = defaultdict(list)
    result = AdvantageResult({}, {})
    seen: set[str] = set()
    for run in rollouts:
        if run.rollout_id in seen:
            raise ValueError(f"rollout {run.rollout_id!r} appears twice in the step")
        seen.add(run.rollout_id)
        reward, reason = _reward_of(run, include_failed, failed_reward)
        if reason is not None:
            result.excluded[run.rollout_id] = reason
            continue
        assert reward is not None
        if not math.isfinite(reward):
            raise ValueError(f"run {run.rollout_id!r} has a non-finite reward {reward!r}")
        groups[run.group_id].append((run.rollout_id, reward))
    for members in groups.values():
        r = np.array([rw for _, rw in members], dtype=np.float64)
        if drop_zero_variance and np.ptp(r) == 0.0:
            # Every run scored the same: no signal, and it would only dilute the denominators.
            for rid, _ in members:
                result.excluded[rid] = "zero_variance_group"
            continue
        adv = _group_advantages(r, est, std_normalize, eps)
        for (rid, rw), a in zip(members, adv, strict=True):
            result.advantages[rid] = float(a)
            result.rewards[rid] = rw
    return result
