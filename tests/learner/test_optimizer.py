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


# Two steps of gradients over two leaves, all entries >= 0 so no sum in Adam cancels. Global
# norms 1300 and sqrt(19) ~ 4.36: a threshold of 1 clips both, 100 only the first, 1e4 neither.
STEPS = [
    {"w": [300.0, 400.0, 0.0], "b": [0.0, 0.0, 1200.0]},
    {"w": [3.0, 1.0, 2.0], "b": [2.0, 0.0, 1.0]},
]
PARAMS = {"w": [0.5, 1.0, 2.0], "b": [1.0, 0.25, 0.75]}
# b2 = 0.75 rather than the default 0.999: 1 - b2**t is then well conditioned, so the float32
# optimizer can be compared with a float64 reference elementwise (with 0.999, rounding b2**2 to
# float32 alone moves 1 - b2**2 by ~500 ulps); clipping does not depend on the betas.
CLIP_CONFIG = {"learning_rate": 0.1, "b1": 0.5, "b2": 0.75, "weight_decay": 0.1}


def _reference_update(clip: float) -> dict[str, np.ndarray]:
    """optax's clip_by_global_norm (g * min(1, clip / ||g||), one norm over all leaves) then
    AdamW, in float64; returns the second step's update."""
    cfg = LearnerConfig(grad_clip_norm=clip, **CLIP_CONFIG)
    params = {k: np.asarray(v) for k, v in PARAMS.items()}
    m = {k: np.zeros(3) for k in params}
    v = {k: np.zeros(3) for k in params}
    update = {}
    for t, grads in enumerate(STEPS, start=1):
        g = {k: np.asarray(x) for k, x in grads.items()}
        norm = np.sqrt(sum(np.sum(x**2) for x in g.values()))
        g = {k: x * min(1.0, clip / norm) for k, x in g.items()}
        for k in params:
            m[k] = cfg.b1 * m[k] + (1 - cfg.b1) * g[k]
            v[k] = cfg.b2 * v[k] + (1 - cfg.b2) * g[k] ** 2
            m_hat, v_hat = m[k] / (1 - cfg.b1**t), v[k] / (1 - cfg.b2**t)
            step = m_hat / (np.sqrt(v_hat) + 1e-8) + cfg.weight_decay * params[k]
            update[k] = -cfg.learning_rate * step
    return update


def _our_update(clip: float) -> dict[str, np.ndarray]:
    opt = make_optimizer(LearnerConfig(grad_clip_norm=clip, **CLIP_CONFIG))
    params = {k: jnp.asarray(v, jnp.float32) for k, v in PARAMS.items()}
    state = opt.init(params)
    for grads in STEPS:
        updates, state = opt.update(
            {k: jnp.asarray(x, jnp.float32) for k, x in grads.items()}, state, params
        )
    return {k: np.asarray(x, np.float64) for k, x in updates.items()}


@pytest.mark.parametrize("clip", [1.0, 100.0, 1e4, math.inf])
def test_global_norm_clipping_scales_gradients_above_the_threshold_only(clip):
    # ~15 float32 roundings per element (norm, moments, bias corrections, sqrt, divide, decay,
    # learning rate), each <= eps/2 relative and none cancelling: <= 8 eps; 32 eps leaves 4x.
    rtol = 32 * np.finfo(np.float32).eps
    got, want = _our_update(clip), _reference_update(clip)
    for k in PARAMS:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=0)
    if clip >= 1e4:  # neither step's norm reaches it: exactly the unclipped optimizer
        unclipped = _our_update(math.inf)
        for k in PARAMS:
            np.testing.assert_allclose(got[k], unclipped[k], rtol=rtol, atol=0)


def test_clipping_changes_the_update_when_the_norm_exceeds_the_threshold():
    clipped, unclipped = _our_update(1.0), _our_update(math.inf)
    # Both steps scaled to norm 1 change how Adam weighs them against each other: the second
    # step's update moves by far more than float32 rounding (the test above's 32 eps).
    gap = max(np.max(np.abs(clipped[k] - unclipped[k]) / np.abs(unclipped[k])) for k in PARAMS)
    assert gap > 1e-2, gap


def test_config_rejects_bad_values_naming_them():
    with pytest.raises(ValueError, match="schedule='linear'"):
        LearnerConfig(schedule="linear")
    with pytest.raises(ValueError, match="compute_dtype='float16'"):
        LearnerConfig(compute_dtype="float16")
    with pytest.raises(ValueError, match="warmup_steps=20"):
        LearnerConfig(warmup_steps=20, total_steps=10)
    with pytest.raises(ValueError, match="learning_rate=0"):
        LearnerConfig(learning_rate=0)
