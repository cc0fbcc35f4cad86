from __future__ import annotations

import json


def test_loss_and_grads_match_single_device_on_every_mesh(run_script):
    report = json.loads(run_script("mesh_parity.py", devices=8).strip().splitlines()[-1])
    assert report["micro_batches"] >= 2
    scale = report["grad_scale"]
    assert scale > 0
    assert set(report["meshes"]) == {"8,1,1", "1,8,1", "2,2,2", "1,4,2"}
    # Bounds from `tinylearn.reorder_tolerance`: 4*L*sqrt(n) ulps of the gradients' (and the loss
    # terms') scale, n = token slots summed in the step.
    for name, r in report["meshes"].items():
        assert abs(r["loss"] - r["ref_loss"]) <= report["loss_tol"], (name, r, report["loss_tol"])
        assert r["max_abs_grad_diff"] <= report["grad_tol"], (name, r, report["grad_tol"])
    # The meshes really shard: FSDP splits the embed axis, tensor splits heads/mlp/vocab.
    assert any("fsdp" in s for s in report["meshes"]["1,8,1"]["sharded_specs"])
    assert any("tensor" in s for s in report["meshes"]["2,2,2"]["sharded_specs"])
    assert report["meshes"]["8,1,1"]["sharded_specs"] == []  # pure data parallel: replicated
