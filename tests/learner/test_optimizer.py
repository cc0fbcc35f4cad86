from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from harnessrl.learner.config import LearnerConfig
from harnessrl.learner.optimizer import make_optimizer, make_schedule


def test_schedules_warm_up_then_hold_or_decay():
    const = make_schedule(LearnerConfig(learning_rate=1e-3, warmup_steps=10))
    np.testing.assert_allclose(
        [const(0), const(5), const(10), const(500)], [0, 5e-4, 1e-3, 1e-3], rtol=1e-6
    )
    cos = make_schedule(
        LearnerConfig(
            learning_rate=1e-3,
            schedule="cosine",
            warmup_steps=10,
            total_steps=110,
            min_lr_ratio=0.1,
        )
    )
    np.testing.assert_allclose([cos(10), cos(60), cos(110)], [1e-3, 5.5e-4, 1e-4], rtol=1e-5)
    assert make_schedule(LearnerConfig(learning_rate=2e-5))(0) == pytest.approx(2e-5)


def test_global_norm_clipping_bounds_the_first_adam_step():
    params = {"w": jnp.zeros(4)}
    grads = {"w": jnp.array([300.0, 400.0, 0.0, 0.0])}  # norm 500
    for clip in (1.0, math.inf):
        opt = make_optimizer(LearnerConfig(learning_rate=0.1, grad_clip_norm=clip))
        updates, _ = opt.update(grads, opt.init(params), params)
        # Adam normalizes the first step to -lr * sign(g) either way; clipping must not break it.
        np.testing.assert_allclose(updates["w"][:2], [-0.1, -0.1], rtol=1e-4)


def test_config_rejects_bad_values_naming_them():
    with pytest.raises(ValueError, match="schedule='linear'"):
        LearnerConfig(schedule="linear")
    with pytest.raises(ValueError, match="compute_dtype='float16'"):
        LearnerConfig(compute_dtype="float16")
    with pytest.raises(ValueError, match="warmup_steps=20"):
        LearnerConfig(warmup_steps=20, total_steps=10)
    with pytest.raises(ValueError, match="learning_rate=0"):
        LearnerConfig(learning_rate=0)
