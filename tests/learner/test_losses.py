"""Policy-gradient losses against textbook formulas on small random inputs.

Bounds are float32 rounding of the few operations involved, relative to the operands' scale:
a handful of roundings of <= eps/2 each per value, and for an n-term sum the worst case
(n - 1) * eps/2 of the sum of |terms| (not of the sum itself, which may cancel).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harnessrl.learner import losses

EPS32 = float(np.finfo(np.float32).eps)


def _sum_tol(terms: np.ndarray) -> float:
    """Worst-case float32 error of a sum of `terms`, each itself a few roundings off: (n+8) eps."""
    terms = np.abs(np.asarray(terms, np.float64))
    return (terms.size + 8) * EPS32 * float(terms.sum())


def _batch(tokens, mask, behavior, adv, weights):
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return {
        "tokens": jnp.asarray(tokens, jnp.int32),
        "loss_mask": f(mask),
        "behavior_logprobs": f(behavior),
        "advantages": f(adv),
        "token_weights": f(weights),
    }


def test_token_logprobs_are_aligned_to_the_target_token():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    tokens = rng.integers(0, 7, (2, 5))
    logp, entropy = losses.token_logprobs(jnp.asarray(logits), jnp.asarray(tokens))
    ref = jax.nn.log_softmax(logits, axis=-1)
    # logp = logit - logsumexp: both sides round values of scale max|logit| + log V.
    atol = 8 * EPS32 * (np.abs(logits).max() + np.log(7))
    for b in range(2):
        assert logp[b, 0] == 0.0
        for t in range(1, 5):
            np.testing.assert_allclose(logp[b, t], ref[b, t - 1, tokens[b, t]], rtol=0, atol=atol)
            p = np.exp(ref[b, t - 1])
            want = -(p * ref[b, t - 1]).sum()
            np.testing.assert_allclose(entropy[b, t], want, rtol=0, atol=atol + _sum_tol(p))


def test_token_logprobs_gradients_equal_autodiff_of_the_definitions():
    """The hand-written VJP (one exp pass) against autodiff of log_softmax and -sum(p log p)."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(scale=3.0, size=(2, 6, 11)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 11, (2, 6)))
    w_logp, w_ent = (jnp.asarray(rng.normal(size=(2, 6)), jnp.float32) for _ in range(2))

    def textbook(logits_btv):
        logp_btv = jax.nn.log_softmax(logits_btv[:, :-1], axis=-1)
        target = jnp.take_along_axis(logp_btv, tokens[:, 1:, None], axis=-1)[..., 0]
        entropy = -jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1)
        return jnp.sum(w_logp[:, 1:] * target) + jnp.sum(w_ent[:, 1:] * entropy)

    def ours(logits_btv):
        logp, entropy = losses.token_logprobs(logits_btv, tokens)
        return jnp.sum(w_logp * logp) + jnp.sum(w_ent * entropy)

    # Both are 10 weighted terms per row of values up to max|logit| + log V (logp, entropy).
    scale = np.abs(np.asarray(logits)).max() + np.log(11)
    terms = np.abs(np.asarray(w_logp)) * scale + np.abs(np.asarray(w_ent)) * scale
    np.testing.assert_allclose(ours(logits), textbook(logits), rtol=0, atol=_sum_tol(terms))
    want = jax.grad(textbook)(logits)
    got = jax.grad(ours)(logits)
    # Per element ~20 roundings (exp, an 11-term sum, products) in each implementation, of
    # values up to the gradient's own scale: 64 ulps of max |grad|.
    np.testing.assert_allclose(got, want, rtol=0, atol=64 * EPS32 * np.abs(want).max())
    assert np.all(got[:, -1] == 0.0)  # the last position predicts nothing that is trained


def test_ppo_clip_uses_separate_low_and_high_epsilons():
    behavior = jnp.zeros(4)
    logp = jnp.log(jnp.array([0.5, 0.9, 1.2, 1.5]))
    pos, clipped_pos, _, _ = losses.ppo_clip_tis(logp, behavior, jnp.ones(4), 0.2, 0.28, math.inf)
    np.testing.assert_allclose(pos, -np.array([0.5, 0.9, 1.2, 1.28]), rtol=1e-6)
    np.testing.assert_array_equal(clipped_pos, [0, 0, 0, 1])
    neg, clipped_neg, _, _ = losses.ppo_clip_tis(logp, behavior, -jnp.ones(4), 0.2, 0.28, math.inf)
    np.testing.assert_allclose(neg, [0.8, 0.9, 1.2, 1.5], rtol=1e-6)
    np.testing.assert_array_equal(clipped_neg, [1, 0, 0, 0])


def test_truncated_importance_sampling_caps_the_gradient_weight():
    behavior = jnp.log(jnp.array([0.01, 0.5]))
    logp = jnp.log(jnp.array([0.5, 0.5]))  # ratios 50 and 1
    adv = -jnp.ones(2)

    def loss(lp, cap):
        return jnp.sum(losses.ppo_clip_tis(lp, behavior, adv, 0.2, 0.28, cap)[0])

    g_cap = jax.grad(loss)(logp, 2.0)
    g_free = jax.grad(loss)(logp, math.inf)
    np.testing.assert_allclose(g_free, [50.0, 1.0], rtol=1e-5)  # d(-A r)/dlogp = r
    np.testing.assert_allclose(g_cap, [2.0, 1.0], rtol=1e-5)
    _, _, truncated, _ = losses.ppo_clip_tis(logp, behavior, adv, 0.2, 0.28, 2.0)
    np.testing.assert_array_equal(truncated, [1, 0])


def test_k3_kl_is_nonnegative_and_zero_at_equality():
    a = jnp.log(jnp.array([0.1, 0.5, 0.9]))
    np.testing.assert_array_equal(losses.k3_kl(a, a), 0.0)  # exp(0) - 0 - 1, exactly
    b = jnp.log(jnp.array([0.3, 0.2, 0.6]))
    kl = losses.k3_kl(a, b)
    assert (kl > 0).all()
    d = np.asarray(b - a, np.float64)
    # exp(d) - d - 1 cancels: the rounding is relative to its terms, not to the small result.
    atol = 8 * EPS32 * float(np.max(np.exp(d) + np.abs(d) + 1))
    np.testing.assert_allclose(kl, np.exp(d) - d - 1, rtol=0, atol=atol)


def test_loss_is_the_weighted_sum_and_metrics_add_up():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(2, 6, 11)), jnp.float32)
    tokens = rng.integers(0, 11, (2, 6))
    mask = np.ones((2, 6))
    mask[:, 0] = 0
    mask[1, 4:] = 0  # padding tail
    behavior = np.where(mask > 0, -2.5, 123.0)  # junk where untrained must not matter
    weights = mask / mask.sum()
    adv = np.where(np.arange(2)[:, None] == 0, 1.0, -0.5) * np.ones((2, 6))
    fn = losses.make_token_loss(0.2, 0.28, 2.0, 0.0, 0.0)
    loss, m = fn(logits, _batch(tokens, mask, behavior, adv, weights), None)
    logp, _ = losses.token_logprobs(logits, jnp.asarray(tokens))
    pg, clipped, _, ratio = losses.ppo_clip_tis(
        logp, jnp.asarray(behavior, jnp.float32), jnp.asarray(adv, jnp.float32), 0.2, 0.28, 2.0
    )
    terms = weights * np.where(mask > 0, pg, 0)
    np.testing.assert_allclose(loss, np.sum(terms), rtol=0, atol=_sum_tol(terms))
    assert m["tokens"] == mask.sum()
    np.testing.assert_allclose(m["clip_frac"], np.sum(mask * clipped), rtol=1e-6)
    np.testing.assert_allclose(m["ratio"], np.sum(mask * ratio), rtol=1e-5)
    assert np.isfinite(float(m["behavior_kl"])) and float(m["behavior_kl"]) >= 0
    assert float(m["ref_kl"]) == 0.0
    final = losses.finalize_metrics({k: float(v) for k, v in m.items()})
    np.testing.assert_allclose(final["clip_frac"], float(m["clip_frac"]) / mask.sum())


def test_reference_kl_and_entropy_terms_change_loss_only_when_enabled():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(1, 5, 9)), jnp.float32)
    ref_logits = jnp.asarray(rng.normal(size=(1, 5, 9)), jnp.float32)
    mask = np.array([[0, 1, 1, 1, 1]], float)
    batch = _batch(rng.integers(0, 9, (1, 5)), mask, np.full((1, 5), -2.0), mask, mask / 4)
    base, _ = losses.make_token_loss(0.2, 0.28, 2.0, 0.0, 0.0)(logits, batch, None)
    with_kl, m = losses.make_token_loss(0.2, 0.28, 2.0, 0.5, 0.0)(logits, batch, ref_logits)
    logp, entropy = losses.token_logprobs(logits, batch["tokens"])
    ref_logp, _ = losses.token_logprobs(ref_logits, batch["tokens"])
    kl = losses.k3_kl(logp, ref_logp)
    # Differences of two losses: their terms' rounding, not the small difference, sets the bound.
    pg_terms = np.ravel(mask / 4 * 2.0)  # |per-token PPO-TIS loss| <= |A| * tis_cap
    kl_tol = _sum_tol(np.concatenate([pg_terms, pg_terms, np.ravel(0.5 * mask / 4 * kl)]))
    np.testing.assert_allclose(with_kl - base, 0.5 * np.sum(mask / 4 * kl), rtol=0, atol=kl_tol)
    assert float(m["ref_kl"]) > 0
    with_ent, _ = losses.make_token_loss(0.2, 0.28, 2.0, 0.0, 0.1)(logits, batch, None)
    ent_terms = np.ravel(0.1 * mask / 4 * entropy)
    ent_tol = _sum_tol(np.concatenate([pg_terms, pg_terms, ent_terms]))
    np.testing.assert_allclose(
        base - with_ent, 0.1 * np.sum(mask / 4 * entropy), rtol=0, atol=ent_tol
    )


def test_bad_coefficients_are_rejected_with_their_values():
    with pytest.raises(ValueError, match=r"tis_cap=1\.1"):
        losses.make_token_loss(0.2, 0.28, 1.1, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"eps_low=1\.5"):
        losses.make_token_loss(1.5, 0.28, 2.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="kl_coef=-1"):
        losses.make_token_loss(0.2, 0.28, 2.0, -1, 0.0)
