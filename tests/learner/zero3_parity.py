"""Subprocess (8 simulated CPU devices): one step on data=2,fsdp=4 with the plain rules and with
ZeRO-3, as JSON: each array's largest addressable shard, and both steps' losses and params."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import optax
from tinylearn import (
    EPS32,
    GRADIENT_PROBE,
    flat,
    loss_scale,
    random_step,
    reorder_tolerance,
    tiny_model,
)

from harnessrl.learner.mesh import make_mesh
from harnessrl.learner.params import gather_to_host
from harnessrl.learner.step import Learner


def shard_fractions(tree) -> list[float]:
    """Per array, the largest addressable shard's share of the whole array."""
    return [
        max(math.prod(s.data.shape) for s in x.addressable_shards) / math.prod(x.shape)
        for x in jax.tree.leaves(tree)
        if x.ndim
    ]


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    batches = random_step(seed=5, count=12, buckets=((8, 64),))
    out: dict = {"loss_tol": reorder_tolerance(loss_scale(batches, GRADIENT_PROBE), batches)}
    params, grads = {}, {}
    for zero3 in (False, True):
        cfg = GRADIENT_PROBE.replace(zero3=zero3)
        learner = Learner(tiny_model(), cfg, mesh=make_mesh("data=2,fsdp=4,tensor=1"))
        metrics = learner.train_step(batches)
        mu = optax.tree.get(learner.opt_state, "mu")
        out[str(zero3)] = {
            "loss": metrics["loss"],
            "params": shard_fractions(learner.params),
            "mu": shard_fractions(mu),
            "accumulator": shard_fractions(learner._grads),
        }
        params[zero3] = flat(gather_to_host(learner.params))
        grads[zero3] = flat(gather_to_host(mu))  # b1 = 0: the step's gradient itself
    scale = float(np.abs(grads[False]).max())
    out["max_abs_grad_diff"] = float(np.abs(grads[True] - grads[False]).max())
    out["grad_tol"] = reorder_tolerance(scale, batches)
    # The updated params differ by those gradients' rounding, through AdamW's first step (a
    # move of about lr per param), and by one rounding of the sum: an ulp of the largest param.
    out["max_abs_param_diff"] = float(np.abs(params[True] - params[False]).max())
    out["param_tol"] = 2 * EPS32 * float(np.abs(params[False]).max()) + reorder_tolerance(
        GRADIENT_PROBE.learning_rate, batches
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
