"""Engine stage, sampling: fp32 logits and per-row settings → sampled tokens and raw logprobs.

`sample_tokens` runs inside the engine's jitted step with static shapes (one row per KV-cache
slot). Returned logprobs are the model's raw distribution (log_softmax of the fp32 logits, before
temperature/top-k/top-p), as vLLM returns by default, so they match the learner's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

# OpenAI caps top_logprobs at 20; the engine always computes this many so shapes never change.
MAX_TOP_LOGPROBS = 20
INT32_MAX = (1 << 31) - 1  # the sampler's per-row settings are int32 device arrays


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler; validated at the HTTP edge."""

    max_tokens: int | None = None  # None: fill the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: none; k >= 0: sampled token plus top-k


def _bisect(pred: Any, lo_s: jax.Array, hi_s: jax.Array, iters: int = 32) -> jax.Array:
    """Per row, the largest t in [lo, hi] with pred(t) (pred(lo) holds; pred falls as t grows)."""

    def body(_: Any, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = (lo + hi) * 0.5
        ok = pred(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    return jax.lax.fori_loop(0, iters, body, (lo_s, hi_s))[0]


def _filter_mask(
    scaled_sv: jax.Array, top_k_s: jax.Array, top_p_s: jax.Array, min_p_s: jax.Array
) -> jax.Array:
    """Which tokens top-k, then top-p and min-p keep, found by bisecting thresholds (no sort)."""
    vocab = scaled_sv.shape[-1]
    k_s = jnp.where(top_k_s > 0, jnp.minimum(top_k_s, vocab), vocab)
    kth_s = _bisect(
        lambda t: jnp.sum(scaled_sv >= t[:, None], axis=-1) >= k_s,
        jnp.min(scaled_sv, axis=-1),
        jnp.max(scaled_sv, axis=-1),
    )
    keep_sv = scaled_sv >= kth_s[:, None]
    probs_sv = jax.nn.softmax(jnp.where(keep_sv, scaled_sv, -jnp.inf), axis=-1)
    top_s = jnp.max(probs_sv, axis=-1)
    # The smallest set of most likely tokens whose mass reaches top_p: the highest probability
    # floor that still keeps top_p of the mass.
    floor_s = _bisect(
        lambda t: jnp.sum(jnp.where(probs_sv >= t[:, None], probs_sv, 0.0), axis=-1) >= top_p_s,
        jnp.zeros_like(top_s),
        top_s,
    )
    floor_s = jnp.where(top_p_s >= 1.0, 0.0, floor_s)
    return keep_sv & (probs_sv >= jnp.maximum(floor_s, min_p_s * top_s)[:, None])


CDF_BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF


def _inverse_cdf(probs_sv: jax.Array, uniform_s: jax.Array) -> jax.Array:
    """Per row, the first index whose running mass exceeds `uniform x total mass`.

    Two levels, so no pass runs a scan over the whole vocabulary: block masses and their running
    sum find the block, then one block's running sum finds the entry. A full-vocabulary cumsum
    cost more than the rest of the sampler together.
    """
    rows, vocab = probs_sv.shape
    padded_sv = jnp.pad(probs_sv, ((0, 0), (0, -vocab % CDF_BLOCK)))
    blocks_snb = padded_sv.reshape(rows, -1, CDF_BLOCK)
    mass_sn = jnp.sum(blocks_snb, axis=-1)
    ends_sn = jnp.cumsum(mass_sn, axis=-1)
    target_s = uniform_s * ends_sn[:, -1]
    last_block = blocks_snb.shape[1] - 1
    block_s = jnp.minimum(jnp.sum(ends_sn <= target_s[:, None], axis=-1), last_block)
    start_s = jnp.take_along_axis(ends_sn - mass_sn, block_s[:, None], axis=-1)[:, 0]
    inner_sb = jnp.take_along_axis(blocks_snb, block_s[:, None, None], axis=1)[:, 0]
    inner_ends_sb = start_s[:, None] + jnp.cumsum(inner_sb, axis=-1)
    offset_s = jnp.minimum(jnp.sum(inner_ends_sb <= target_s[:, None], axis=-1), CDF_BLOCK - 1)
    return jnp.minimum(block_s * CDF_BLOCK + offset_s, vocab - 1)


def sample_tokens(
    logits_sv: jax.Array,
    temperature_s: jax.Array,
    top_p_s: jax.Array,
    top_k_s: jax.Array,
    min_p_s: jax.Array,
    keys_s2: jax.Array,
    salts_s: jax.Array,
    steps_s: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One token per row → (token_s, logprob_s, top_ids_sk, top_logprobs_sk).

    Every row runs the same program whatever its settings: filters are per-row thresholds
    (skipped at run time when no row asks for one), then inverse-CDF sampling with one uniform
    per row; temperature 0 means greedy. `keys_s2` are raw uint32 keys, one per row, folded with
    the row's salt (its choice index) and step, so a seeded request is reproducible whatever it
    is batched with. A full-vocabulary sort or Gumbel noise would cost more than the model step.
    """
    logits_sv = logits_sv.astype(jnp.float32)
    vocab = logits_sv.shape[-1]
    logprobs_sv = jax.nn.log_softmax(logits_sv, axis=-1)
    greedy_s = temperature_s <= 0.0
    scaled_sv = logits_sv / jnp.where(greedy_s, 1.0, temperature_s)[:, None]
    filtering = jnp.any((top_k_s > 0) | (top_p_s < 1.0) | (min_p_s > 0.0))
    keep_sv = jax.lax.cond(
        filtering,
        _filter_mask,
        lambda x, *_: jnp.ones(x.shape, bool),
        scaled_sv,
        top_k_s,
        top_p_s,
        min_p_s,
    )
    probs_sv = jax.nn.softmax(jnp.where(keep_sv, scaled_sv, -jnp.inf), axis=-1)

    def uniform(key_2: jax.Array, salt: jax.Array, step: jax.Array) -> jax.Array:
        key_2 = jax.random.fold_in(jax.random.fold_in(key_2, salt), step)
        return jax.random.uniform(key_2, (), jnp.float32)

    drawn_s = _inverse_cdf(probs_sv, jax.vmap(uniform)(keys_s2, salts_s, steps_s))
    # Rounding can land on a zero-probability token at the edges; fall back to the mode.
    drawn_kept_s = jnp.take_along_axis(keep_sv, drawn_s[:, None], axis=-1)[:, 0]
    best_s = jnp.argmax(jnp.where(keep_sv, scaled_sv, -jnp.inf), axis=-1)
    sampled_s = jnp.where(
        drawn_kept_s & (jnp.take_along_axis(probs_sv, drawn_s[:, None], axis=-1)[:, 0] > 0),
        drawn_s,
        best_s,
    )
    token_s = jnp.where(greedy_s, jnp.argmax(logits_sv, axis=-1), sampled_s).astype(jnp.int32)
    logprob_s = jnp.take_along_axis(logprobs_sv, token_s[:, None], axis=-1)[:, 0]
    top_lp_sk, top_ids_sk = jax.lax.top_k(logprobs_sv, min(MAX_TOP_LOGPROBS, vocab))
    return token_s, logprob_s, top_ids_sk.astype(jnp.int32), top_lp_sk
