from __future__ import annotations

import socket

import numpy as np
from tinylearn import (
    EPS32,
    GRADIENT_PROBE,
    flat,
    loss_scale,
    random_step,
    reorder_tolerance,
    step_gradient,
    tiny_model,
)

from harnessrl.learner.config import LearnerConfig
from harnessrl.learner.step import Learner


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_global_mesh_step_matches_single_process(run_script, tmp_path):
    port = _free_port()
    out = tmp_path / "multihost.npz"
    procs = []
    for pid in range(2):
        env = {
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(pid),
        }
        procs.append(run_script("multihost_step.py", str(out), devices=4, env=env, background=True))
    try:
        outputs = [p.communicate(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (stdout, stderr) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, f"{stdout}\n{stderr[-4000:]}"
        assert "done" in stdout
    # The same step in this (single-device) process.
    lr = 1e-2
    learner = Learner(tiny_model(), GRADIENT_PROBE.replace(learning_rate=lr))
    batches = random_step(seed=21, count=24, buckets=((8, 64),))
    metrics, grads = step_gradient(learner, batches)
    got = np.load(out)
    # Two processes reorder the same float32 sums (`tinylearn.reorder_tolerance`). The norms of
    # two gradients differ by at most the norm of their gap, <= sqrt(N) * max gap, plus the
    # norm's own N-term float32 sum (~sqrt(N) ulps of it, random-walk model).
    ref_grads = flat(grads)
    grad_tol = reorder_tolerance(float(np.abs(ref_grads).max()), batches)
    loss_tol = reorder_tolerance(loss_scale(batches, LearnerConfig()), batches)
    assert abs(float(got["loss"]) - metrics["loss"]) <= loss_tol
    root_n = np.sqrt(ref_grads.size)
    norm_tol = root_n * (grad_tol + EPS32 * metrics["grad_norm"])
    assert abs(float(got["grad_norm"]) - metrics["grad_norm"]) <= norm_tol
    assert np.abs(got["grads"] - ref_grads).max() <= grad_tol
    # Adam's first step is about lr * sign(g): where |g| is near zero, last-bit differences in the
    # cross-process reduction order move a weight by a fraction of lr, never more.
    np.testing.assert_allclose(got["params"], flat(learner.params_state()), atol=1e-2 * lr, rtol=0)
