"""Subprocess: one process of a 2-process `jax.distributed` CPU job (4 devices each).

Both processes build one global 8-device mesh, feed their own rows of the same micro-batches,
run one learner step and (process 0) save the resulting params and metrics to OUT.npz.
"""

from __future__ import annotations

import sys

import jax
import numpy as np

from harnessrl.learner.mesh import init_distributed, make_mesh


def main(out: str) -> None:
    assert init_distributed(), "JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID unset"
    from tinylearn import GRADIENT_PROBE, flat, random_step, rows_of, step_gradient, tiny_model

    from harnessrl.learner.step import Learner

    pid, count = jax.process_index(), jax.process_count()
    assert count == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    cfg = GRADIENT_PROBE.replace(learning_rate=1e-2)
    learner = Learner(tiny_model(), cfg, mesh=make_mesh("data=2,fsdp=2,tensor=2"))
    batches = random_step(seed=21, count=24, buckets=((8, 64),))
    local = [rows_of(b, pid, count) for b in batches]
    metrics, grads = step_gradient(learner, local)
    params = flat(learner.params_state())
    if pid == 0:
        np.savez(
            out,
            params=params,
            grads=flat(grads),
            loss=metrics["loss"],
            grad_norm=metrics["grad_norm"],
        )
    print(f"process {pid} done loss={metrics['loss']:.6f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
