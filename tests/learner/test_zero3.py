"""ZeRO-3: params, gradient accumulators and AdamW moments shard over data x fsdp, and a step
trains exactly as the plain FSDP rules do."""

from __future__ import annotations

import json
import os

import pytest

from harnessrl.learner.mesh import LOGICAL_AXIS_RULES, logical_axis_rules


def test_zero3_rules_derive_from_the_one_table():
    plain, zero3 = dict(LOGICAL_AXIS_RULES), dict(logical_axis_rules(zero3=True))
    assert logical_axis_rules(zero3=False) is LOGICAL_AXIS_RULES
    assert plain.keys() == zero3.keys()
    assert zero3["embed"] == ("data", "fsdp") and plain["embed"] == "fsdp"
    # Everything not on fsdp alone, the batch rows among them, keeps its rule.
    assert {k: v for k, v in zero3.items() if k != "embed"} == {
        k: v for k, v in plain.items() if k != "embed"
    }


@pytest.mark.skipif(
    not os.environ.get("HARNESSRL_SLOW"),
    reason="two learners on 8 simulated devices (about 45 s): set HARNESSRL_SLOW=1",
)
def test_zero3_step_shards_state_eight_ways_and_matches_fsdp(run_script):
    report = json.loads(run_script("zero3_parity.py", devices=8).strip().splitlines()[-1])
    plain, zero3 = report["False"], report["True"]
    for part in ("params", "mu", "accumulator"):
        assert plain[part] and all(f == 1 / 4 for f in plain[part]), (part, plain[part])
        assert all(f == 1 / 8 for f in zero3[part]), (part, zero3[part])
    assert abs(zero3["loss"] - plain["loss"]) <= report["loss_tol"]
    assert report["max_abs_grad_diff"] <= report["grad_tol"], report
    assert report["max_abs_param_diff"] <= report["param_tol"], report
