"""Sampler: raw logprobs, greedy, top-k/top-p/min-p support, seeds; request-field validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harnessrl.serve.sampling import MAX_TOP_LOGPROBS, SamplingParams, parse_sampling, sample_tokens

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


def test_parse_sampling_defaults_follow_vllm():
    chat = parse_sampling({}, chat=True)
    completion = parse_sampling({}, chat=False)
    assert chat.max_tokens is None and completion.max_tokens == 16
    assert chat.temperature == 1.0 and chat.n == 1 and chat.logprobs is None
    assert parse_sampling({"logprobs": True, "top_logprobs": 3}, chat=True).logprobs == 3
    assert parse_sampling({"logprobs": 2}, chat=False).logprobs == 2
    assert parse_sampling({"stop": "x", "top_k": -1}, chat=False) == SamplingParams(
        max_tokens=16, stop=("x",), top_k=0
    )
    assert parse_sampling({"max_completion_tokens": 5}, chat=True).max_tokens == 5


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n must be"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": "a"}, "seed"),
        ({"top_logprobs": 2}, "needs logprobs=true"),
        ({"logprobs": True, "top_logprobs": 99}, "<= 20"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_parse_sampling_rejects_bad_fields(body, needle):
    with pytest.raises(ValueError, match=needle):
        parse_sampling(body, chat=True)
