"""Sampler: raw logprobs, greedy, top-k/top-p/min-p support, seeds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harnessrl.engine.sampler import MAX_TOP_LOGPROBS, sample_tokens

VOCAB = 64
_sample = jax.jit(sample_tokens)


def _run(logits_v, *, temp=1.0, top_p=1.0, top_k=0, min_p=0.0, rows=256, seed=0):
    logits = jnp.broadcast_to(jnp.asarray(logits_v, jnp.float32), (rows, len(logits_v)))
    full = lambda v, dt: jnp.full((rows,), v, dt)  # noqa: E731
    keys = jnp.tile(jnp.asarray([[0, seed]], jnp.uint32), (rows, 1))
    return _sample(
        logits,
        full(temp, jnp.float32),
        full(top_p, jnp.float32),
        full(top_k, jnp.int32),
        full(min_p, jnp.float32),
        keys,
        jnp.zeros(rows, jnp.int32),
        jnp.arange(rows, dtype=jnp.int32),
    )


def _logits():
    return np.linspace(3.0, -3.0, VOCAB).astype(np.float32)  # token 0 most likely


def test_logprobs_are_raw_log_softmax_before_temperature():
    logits = _logits()
    token, logprob, top_ids, top_lps = _run(logits, temp=0.3)
    raw = np.asarray(jax.nn.log_softmax(logits))
    # Two float32 log-softmaxes that sum the vocabulary in different orders: the log-sum-exp
    # differs by ~sqrt(V) ulps of its terms, and each result carries a few ulps of its scale.
    eps = float(np.finfo(np.float32).eps)
    tol = 2 * np.sqrt(VOCAB) * eps + 8 * eps * (np.abs(logits).max() + np.log(VOCAB))
    np.testing.assert_allclose(np.asarray(logprob), raw[np.asarray(token)], rtol=0, atol=tol)
    assert top_ids.shape == (256, MAX_TOP_LOGPROBS)
    np.testing.assert_array_equal(np.asarray(top_ids[0]), np.arange(MAX_TOP_LOGPROBS))
    np.testing.assert_allclose(np.asarray(top_lps[0]), raw[:MAX_TOP_LOGPROBS], rtol=0, atol=tol)


def test_temperature_zero_is_greedy():
    logits = np.random.default_rng(0).normal(size=VOCAB).astype(np.float32)
    token, *_ = _run(logits, temp=0.0, rows=8)
    assert set(np.asarray(token).tolist()) == {int(np.argmax(logits))}


@pytest.mark.parametrize(
    ("kwargs", "allowed"),
    [
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_k": 1, "top_p": 0.9}, {0}),
        ({"top_p": 1e-6}, {0}),
        ({"min_p": 0.99}, {0}),
    ],
)
def test_filters_restrict_support(kwargs, allowed):
    token, *_ = _run(_logits(), **kwargs)
    assert set(np.asarray(token).tolist()) <= allowed


def test_top_p_keeps_smallest_prefix_reaching_mass():
    # Probabilities 0.5, 0.3, 0.2 (+ nothing else): top_p=0.7 keeps the first two only.
    logits = np.log(np.array([0.5, 0.3, 0.2], np.float32))
    token, *_ = _run(logits, top_p=0.7, rows=512)
    seen = set(np.asarray(token).tolist())
    assert seen == {0, 1}


def test_unfiltered_sampling_covers_the_distribution():
    token, *_ = _run(np.zeros(4, np.float32), rows=512)
    counts = np.bincount(np.asarray(token), minlength=4)
    assert counts.min() > 80  # uniform over 4: ~128 each


def test_same_key_same_tokens_and_seed_changes_them():
    a = np.asarray(_run(_logits(), seed=1)[0])
    b = np.asarray(_run(_logits(), seed=1)[0])
    c = np.asarray(_run(_logits(), seed=2)[0])
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
