"""Subprocess (8 simulated CPU devices): loss and gradients per mesh vs one device, as JSON."""

from __future__ import annotations

import json

import jax
import numpy as np
from tinylearn import (
    GRADIENT_PROBE,
    flat,
    loss_scale,
    random_step,
    reorder_tolerance,
    step_gradient,
    tiny_model,
)

from harnessrl.learner.mesh import make_mesh
from harnessrl.learner.step import Learner

MESHES = {
    "8,1,1": "data=8,fsdp=1,tensor=1",
    "1,8,1": "data=1,fsdp=8,tensor=1",
    "2,2,2": "data=2,fsdp=2,tensor=2",
    "1,4,2": "data=1,fsdp=4,tensor=2",
}


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    batches = random_step(seed=11, count=24, buckets=((8, 64),))
    cfg = GRADIENT_PROBE
    single = Learner(tiny_model(), cfg, mesh=make_mesh("dp", jax.devices()[:1]))
    ref_metrics, ref_grads = step_gradient(single, batches)
    ref = flat(ref_grads)
    scale = float(np.abs(ref).max())
    out = {
        "micro_batches": len(batches),
        "grad_scale": scale,
        # Sharding reorders the same float32 sums (all-reduces over data/fsdp, split matmuls).
        "grad_tol": reorder_tolerance(scale, batches),
        "loss_tol": reorder_tolerance(loss_scale(batches, cfg), batches),
        "meshes": {},
    }
    for name, spec in MESHES.items():
        learner = Learner(tiny_model(), cfg, mesh=make_mesh(spec))
        sharded = {str(s.spec) for s in jax.tree.leaves(learner.param_shardings) if any(s.spec)}
        metrics, grads = step_gradient(learner, batches)
        out["meshes"][name] = {
            "loss": metrics["loss"],
            "ref_loss": ref_metrics["loss"],
            "max_abs_grad_diff": float(np.abs(flat(grads) - ref).max()),
            "sharded_specs": sorted(sharded),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
