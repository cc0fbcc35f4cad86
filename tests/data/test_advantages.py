from __future__ import annotations

import numpy as np
import pytest
from trace_factory import make_run

from harnessrl.data.advantages import compute_advantages
from harnessrl.traces.schema import RolloutState


def _runs(rewards, group="g"):
    return [make_run(f"{group}{i}", group, r) for i, r in enumerate(rewards)]


def test_grpo_normalizes_by_group_std_and_can_skip_it():
    res = compute_advantages(_runs([1.0, 0.0, 0.0, 1.0]), estimator="grpo")
    assert [round(res.advantages[f"g{i}"], 4) for i in range(4)] == [1.0, -1.0, -1.0, 1.0]
    raw = compute_advantages(_runs([1.0, 0.0, 0.0, 0.0]), std_normalize=False)
    assert raw.advantages["g0"] == pytest.approx(0.75)


def test_rloo_uses_the_mean_of_the_other_runs():
    res = compute_advantages(_runs([3.0, 1.0, 2.0]), estimator="rloo")
    assert res.advantages["g0"] == pytest.approx(3.0 - 1.5)
    assert res.advantages["g1"] == pytest.approx(1.0 - 2.5)


def test_dr_grpo_centers_without_std_and_groups_are_independent():
    runs = _runs([2.0, 0.0], "a") + _runs([10.0, 0.0, 5.0], "b")
    res = compute_advantages(runs, estimator="dr_grpo")
    assert res.advantages["a0"] == pytest.approx(1.0)
    assert res.advantages["b0"] == pytest.approx(5.0)
    assert sum(res.advantages.values()) == pytest.approx(0.0)


def test_zero_variance_groups_are_dropped_or_kept_as_configured():
    runs = _runs([1.0, 1.0], "same") + _runs([1.0], "alone") + _runs([0.0, 1.0], "mixed")
    res = compute_advantages(runs)
    assert set(res.advantages) == {"mixed0", "mixed1"}
    assert res.excluded == dict.fromkeys(["same0", "same1", "alone0"], "zero_variance_group")
    kept = compute_advantages(runs, drop_zero_variance=False, estimator="rloo")
    assert kept.advantages["same0"] == 0.0 and kept.advantages["alone0"] == 0.0


def test_failed_runs_are_excluded_by_default_never_trained_as_zero():
    runs = [
        *_runs([1.0, 0.5]),
        make_run("f", "g", None, RolloutState.FAILED),
        make_run("t", "g", None, RolloutState.TIMED_OUT),
        make_run("q", "g", None, RolloutState.RUNNING),
        make_run("n", "g", None),
    ]
    res = compute_advantages(runs)
    assert set(res.advantages) == {"g0", "g1"}
    assert res.excluded == {"f": "failed", "t": "timed_out", "q": "not_finished", "n": "no_reward"}
    with pytest.raises(ValueError, match="failed_reward"):
        compute_advantages(runs, include_failed=True)
    inc = compute_advantages(runs, include_failed=True, failed_reward=-1.0, std_normalize=False)
    assert inc.rewards["f"] == -1.0 and inc.rewards["t"] == -1.0
    assert np.mean(list(inc.advantages.values())) == pytest.approx(0.0)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="estimator"):
        compute_advantages(_runs([1.0]), estimator="ppo")
    with pytest.raises(ValueError, match="eps"):
        compute_advantages(_runs([1.0]), eps=0.0)
    with pytest.raises(ValueError, match="twice"):
        compute_advantages(_runs([1.0]) + _runs([0.0]))
    with pytest.raises(ValueError, match="non-finite"):
        compute_advantages(_runs([float("nan"), 1.0]))
