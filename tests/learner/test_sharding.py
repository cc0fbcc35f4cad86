from __future__ import annotations

import json

import pytest


def test_loss_and_grads_match_single_device_on_every_mesh(run_script):
    report = json.loads(run_script("mesh_parity.py", devices=8).strip().splitlines()[-1])
    assert report["micro_batches"] >= 2
    scale = report["grad_scale"]
    assert scale > 0
    assert set(report["meshes"]) == {"8,1,1", "1,8,1", "2,2,2", "1,4,2"}
    for name, r in report["meshes"].items():
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5, abs=1e-7), name
        assert r["max_abs_grad_diff"] <= 1e-5 * scale, (name, r["max_abs_grad_diff"], scale)
    # The meshes really shard: FSDP splits the embed axis, tensor splits heads/mlp/vocab.
    assert any("fsdp" in s for s in report["meshes"]["1,8,1"]["sharded_specs"])
    assert any("tensor" in s for s in report["meshes"]["2,2,2"]["sharded_specs"])
    assert report["meshes"]["8,1,1"]["sharded_specs"] == []  # pure data parallel: replicated
