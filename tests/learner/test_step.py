from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tinylearn import (
    GRADIENT_PROBE,
    flat,
    loss_scale,
    policy_logprobs,
    random_step,
    reorder_tolerance,
    step_gradient,
    tiny_model,
)

from harnessrl.data.pack import PackedBatch
from harnessrl.learner import losses
from harnessrl.learner.config import LearnerConfig
from harnessrl.learner.mesh import use_mesh
from harnessrl.learner.step import Learner

# The model tests' reader of a lowered program's matrix products.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from hlo_dots import assert_all_highest, dots

# Most tests share one small shape and config so the session's compilation cache serves them.
SMALL = ((8, 32),)
STEP_BUCKETS = ((8, 16), (8, 32), (8, 64))


def test_compile_count_is_constant_across_30_steps_of_random_size():
    learner = Learner(tiny_model(), LearnerConfig())
    # Warm-up: one micro-batch of every bucket shape, then one apply.
    learner.train_step([PackedBatch.zeros(*b) for b in STEP_BUCKETS])
    warm = learner.compile_count
    assert warm == len(STEP_BUCKETS) + 1
    rng = np.random.default_rng(0)
    shapes_seen = set()
    for step in range(30):
        batches = random_step(seed=step, count=int(rng.integers(1, 201)), buckets=STEP_BUCKETS)
        shapes_seen.update(b.shape for b in batches)
        metrics = learner.train_step(batches)
        assert learner.compile_count == warm, f"step {step} recompiled"
        assert metrics["compiles"] == warm and np.isfinite(metrics["loss"])
    assert len(shapes_seen) > 1  # the steps really mixed bucket shapes


def test_accumulated_gradient_is_the_policy_gradient_of_the_whole_step():
    learner = Learner(tiny_model(), GRADIENT_PROBE)
    batches = random_step(seed=3, count=24, buckets=SMALL)
    assert len(batches) >= 2
    # Behavior = learner logprobs makes every ratio 1, so the loss is -sum(w * A * logp).
    on_policy = [
        PackedBatch(**{**b.as_dict(), "behavior_logprobs": policy_logprobs(learner, b)})
        for b in batches
    ]
    parts, params = learner.parts, jax.device_get(learner.params)  # before the step moves them
    metrics, grads = step_gradient(learner, on_policy)
    # ratio = exp(logp_step - logp_probe): two programs over the same forward, so |ratio - 1| is
    # the logprob reordering gap, ~ sqrt(V)*eps = 1.3e-6 for the vocabulary sum; 1e-5 is 7x that.
    assert metrics["clip_frac"] == 0.0 and metrics["ratio"] == pytest.approx(1.0, abs=1e-5)

    def reference(params):
        total = 0.0
        for b in on_policy:
            logits = parts.merge(params)(b.tokens, b.positions, b.segment_ids)
            logp, _ = losses.token_logprobs(logits, jnp.asarray(b.tokens))
            total = total - jnp.sum(b.token_weights * b.advantages * logp)
        return total

    ref_grads = jax.jit(jax.grad(reference))(params)
    # The same float32 sums as the learner's, grouped differently (one program per micro-batch,
    # PPO-TIS at ratio 1 vs the plain policy gradient).
    tol = reorder_tolerance(float(np.abs(flat(ref_grads)).max()), on_policy)
    assert np.abs(flat(grads) - flat(ref_grads)).max() <= tol
    # Splitting a step into micro-batches only changes the summation order (fresh learners: the
    # same starting params for each part).
    _, g0 = step_gradient(Learner(tiny_model(), GRADIENT_PROBE), on_policy[:1])
    _, g1 = step_gradient(Learner(tiny_model(), GRADIENT_PROBE), on_policy[1:])
    assert np.abs(flat(g0) + flat(g1) - flat(grads)).max() <= tol


def test_kl_reference_is_frozen_and_pulls_back():
    learner = Learner(tiny_model(), LearnerConfig(learning_rate=3e-2, kl_coef=1.0))
    batches = random_step(seed=5, count=10, buckets=SMALL)
    first = learner.train_step(batches)
    # params == reference at step 0; k3 is second order in the logprob gap (~1e-12 in float32).
    assert first["ref_kl"] == pytest.approx(0.0, abs=1e-6)
    second = learner.train_step(batches)
    assert second["ref_kl"] > 0.0
    assert learner.ref_params is not None
    np.testing.assert_array_equal(
        flat(learner.ref_params), flat(Learner(tiny_model(), LearnerConfig()).params)
    )


def test_bad_batches_fail_with_clear_errors():
    learner = Learner(tiny_model(), GRADIENT_PROBE)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        learner.train_step([])
    # The seven arrays' names, shapes and dtypes are PackedBatch's to check (tests/data/test_pack.py);
    # anything else is refused whole.
    good = PackedBatch.zeros(8, 32).as_dict()
    with pytest.raises(TypeError, match=r"must be a harnessrl\.data\.pack\.PackedBatch, got dict"):
        learner.train_step([good])
    with pytest.raises(TypeError, match="PackedBatch, got ndarray"):
        learner.train_step([np.zeros((8, 32))])
    assert learner.step == 0  # nothing was applied
    with pytest.raises(TypeError, match=r"NNX module.*got dict"):
        Learner({"w": np.zeros(3)}, LearnerConfig())
    with pytest.raises(TypeError, match="LearnerConfig, got dict"):
        Learner(tiny_model(), {"learning_rate": 1e-3})
    # A bad micro-batch after good ones leaves no partial gradient behind.
    batches = random_step(seed=4, count=6, buckets=SMALL)
    with pytest.raises(TypeError, match="PackedBatch, got dict"):
        learner.train_step([*batches, good])
    assert learner.step == 0
    _, grads = step_gradient(learner, batches)
    _, fresh = step_gradient(Learner(tiny_model(), GRADIENT_PROBE), batches)
    np.testing.assert_array_equal(flat(grads), flat(fresh))


def test_bf16_params_compute_and_remat_train_close_to_fp32():
    batches = random_step(seed=7, count=20, buckets=SMALL)
    m32, g32 = step_gradient(Learner(tiny_model(), GRADIENT_PROBE), batches)
    cfg = GRADIENT_PROBE.replace(compute_dtype="bfloat16", param_dtype="bfloat16", remat=True)
    low = Learner(tiny_model(), cfg)
    model_cfg = low.parts.merge(low.params).cfg
    assert (model_cfg.compute_dtype, model_cfg.param_dtype, model_cfg.remat) == (
        "bfloat16",
        "bfloat16",
        True,
    )
    assert {x.dtype for x in jax.tree.leaves(low.params)} == {jnp.dtype(jnp.bfloat16)}
    m16, g16 = step_gradient(low, batches)
    # bfloat16 keeps 8 mantissa bits: each rounding of a param or activation errs by <= 2^-9
    # relative. Each of the L layers adds that to the residual stream, the backward pass walks
    # the path again (x2), and x2 for the random-walk typical case: relative error 4*L*2^-8. The
    # loss's terms carry it too, against their own scale (the loss itself is a cancelling sum).
    rel = 4 * model_cfg.num_layers * 2.0**-8
    assert abs(m16["loss"] - m32["loss"]) <= rel * loss_scale(batches, LearnerConfig())
    assert np.linalg.norm(flat(g16) - flat(g32)) <= rel * np.linalg.norm(flat(g32))


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_micro_step_multiplies_at_the_configured_compute_dtype(compute_dtype):
    """The micro-step's forward and backward products state HIGHEST: float32 compute is float32
    on every backend (not TF32, not one bfloat16 pass), bfloat16 compute multiplies bfloat16."""
    learner = Learner(tiny_model(), GRADIENT_PROBE.replace(compute_dtype=compute_dtype))
    batch = PackedBatch.zeros(*SMALL[0])
    with use_mesh(learner.mesh, learner.rules):
        lowered = learner._micro.lower(
            learner.params, learner.ref_params, learner._grads, learner._sums, learner._put(batch)
        )
    found = dots(lowered)
    assert_all_highest(found)
    operands = {d.operands for d in found}
    if compute_dtype == "float32":
        assert operands == {("f32", "f32")}, operands
    else:  # all but the head's gradient products, which take the float32 logits' gradient
        wide = [d for d in found if d.operands != ("bf16", "bf16")]
        assert len(wide) == 2 and len(found) > 10 * len(wide), wide


def test_layer_scan_unroll_is_automatic_on_cpu_and_does_not_change_the_gradient():
    batches = random_step(seed=3, count=12, buckets=SMALL)
    auto = Learner(tiny_model(), GRADIENT_PROBE)
    layers = auto.parts.merge(auto.params).cfg.num_layers
    assert layers > 1 and auto.parts.merge(auto.params).cfg.scan_unroll == layers  # CPU: all
    scanned = Learner(tiny_model(), GRADIENT_PROBE.replace(scan_unroll=1))
    assert scanned.parts.merge(scanned.params).cfg.scan_unroll == 1
    m_auto, g_auto = step_gradient(auto, batches)
    m_scan, g_scan = step_gradient(scanned, batches)
    # Unrolling changes only how XLA may fuse and order the same float32 sums.
    cfg = LearnerConfig()
    assert abs(m_auto["loss"] - m_scan["loss"]) <= reorder_tolerance(
        loss_scale(batches, cfg), batches
    )
    tol = reorder_tolerance(float(np.abs(flat(g_scan)).max()), batches)
    assert np.abs(flat(g_auto) - flat(g_scan)).max() <= tol
    for bad in (0, -2, True, 1.5):
        with pytest.raises(ValueError, match="scan_unroll"):
            LearnerConfig(scan_unroll=bad)


def test_export_hf_round_trips_the_trained_weights(tmp_path):
    from harnessrl.model.formats.load import load_model

    learner = Learner(tiny_model(), LearnerConfig())
    learner.train_step(random_step(seed=9, count=8, buckets=SMALL))
    learner.export_hf(tmp_path / "hf")
    reloaded = load_model(str(tmp_path / "hf"))
    again = Learner(reloaded.model, LearnerConfig())
    np.testing.assert_array_equal(flat(again.params), flat(learner.params))
    assert not np.array_equal(
        flat(again.params), flat(Learner(tiny_model(), LearnerConfig()).params)
    )
