"""Loading straight into shards: under the learner's mesh a checkpoint's tensors go from the
host to each device's shard, and random policies are initialized already sharded, so no device
holds a whole parameter that the learner splits."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest


def load_report(run_script, tmp_path: Path, loads: str) -> dict:
    out = run_script("sharded_load.py", str(tmp_path / "hf"), loads, devices=8)
    return json.loads(out.strip().splitlines()[-1])


def assert_sharded(report: dict, exact: bool) -> None:
    # The watch would have caught the old way: built whole on device 0, then moved.
    assert report["control_caught"] > 0
    for load in report["loads"]:
        assert load["split"] > 0 and load["samples"] > 0, load
        assert load["wrong_sharding"] == [], load
        assert load["whole_on_one_device"] == [], load
        assert load["copied_by_place"] == 0, load  # the learner keeps the arrays as loaded
        if exact:
            assert load["differ"] == [], load
        else:  # one program's fused init rounds as the op-by-op eager init does, to 1 ulp
            assert load["max_ulps"] <= 1, load


def test_hf_folder_loads_straight_into_fsdp_and_zero3_shards(run_script, tmp_path: Path):
    """Also the loop's own load for a run with remote servers: policy, then learner."""
    report = load_report(run_script, tmp_path, "hf,train")
    assert [r["name"] for r in report["loads"]] == [
        "hf on fsdp zero3=False",
        "hf on data=2,fsdp=4 zero3=True",
        "train with rollout.servers",
    ]
    assert_sharded(report, exact=True)


@pytest.mark.skipif(
    not os.environ.get("HARNESSRL_SLOW"),
    reason="a Qwen3.5 HF folder, and SmolLM2's GGUF dequantized twice (about 90 s): set "
    "HARNESSRL_SLOW=1",
)
def test_qwen3_5_folder_and_gguf_load_straight_into_shards(run_script, tmp_path: Path):
    report = load_report(run_script, tmp_path, "hf-qwen3_5,smollm2")
    assert len(report["loads"]) == 4
    assert_sharded(report, exact=True)


@pytest.mark.skipif(
    not os.environ.get("HARNESSRL_SLOW"),
    reason="compiles four sharded random inits (about 2 minutes): set HARNESSRL_SLOW=1",
)
def test_random_policies_initialize_already_sharded(run_script, tmp_path: Path):
    assert_sharded(load_report(run_script, tmp_path, "tiny,tiny-qwen3_5"), exact=False)


def test_planner_counts_the_load_and_refuses_a_run_whose_load_cannot_fit():
    from harnessrl.learner import plan as planner

    learner, buckets, recipe = planner.run_settings("v5e-32")
    cfg = planner.model_shape("qwen3-8b")
    plan = planner.plan_run(cfg, learner.replace(zero3=True), buckets, recipe, "qwen3-8b")
    # The largest shard is a stacked MLP weight, 36 x 4096 x 12288 in float32 over data x fsdp
    # = 32 (the head, 4096 x 151936, is smaller).
    assert plan.load == 36 * 4096 * 12288 * 4 // 32
    assert plan.load_peak == plan.params + plan.load <= plan.total and plan.fits
    assert "load (params + largest shard)" in planner.table(plan)
    # Were the load the peak (it never is while params are sharded), the refusal would see it.
    heavy = dataclasses.replace(plan, load=plan.chip_bytes)
    assert heavy.total == heavy.load_peak and heavy.fits is False
