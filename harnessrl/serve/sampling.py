"""Serving stage, sampling: request fields → `SamplingParams`; fp32 logits → sampled tokens.

`sample_tokens` runs inside the engine's jitted step with static shapes (one row per KV-cache
slot). Returned logprobs are the model's raw distribution (log_softmax of the fp32 logits, before
temperature/top-k/top-p), as vLLM returns by default, so they match the learner's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

# OpenAI caps top_logprobs at 20; the engine always computes this many so shapes never change.
MAX_TOP_LOGPROBS = 20
INT32_MAX = (1 << 31) - 1  # the sampler's per-row settings are int32 device arrays
# Stop strings are matched (and held back while streaming) on every token of every choice, so
# their number and length bound per-token host work; stop ids are looked up per token too.
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 32, 256, 256


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
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number, got {value!r:.200}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value!r}")
    return float(value)


def _integer(
    body: dict[str, Any], name: str, default: int | None, lo: int, hi: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r:.200}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value!r}")
    return value


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r:.200}")
    return value


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {value!r:.200}")
    if len(value) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in value):
        raise ValueError(
            f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
            f"characters, got {len(value)} (longest {max(map(len, value))})"
        )
    return tuple(value)


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise ValueError(f"{name} must be a list of non-negative integers, got {value!r:.200}")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"{name} takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(value)}")
    return tuple(value)


def _reject_unsupported(body: dict[str, Any]) -> None:
    for name, neutral in (
        ("presence_penalty", 0),
        ("frequency_penalty", 0),
        ("repetition_penalty", 1),
    ):
        value = body.get(name)
        if value is not None and value != neutral:
            raise ValueError(
                f"{name}={value!r:.50} is not supported by this server; omit it or use {neutral}"
            )
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise ValueError(f"best_of={body['best_of']!r:.50} is not supported; omit it")


def parse_sampling(body: dict[str, Any], *, chat: bool) -> SamplingParams:
    """OpenAI/vLLM request body → `SamplingParams`; raises ValueError naming the bad field."""
    _reject_unsupported(body)
    max_tokens = _integer(body, "max_tokens", None if chat else 16, 1)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _integer(body, "max_completion_tokens", None, 1)
    top_k = _integer(body, "top_k", 0, -1, INT32_MAX)  # -1 and 0: off; above the vocab: all
    if chat:
        want = _flag(body, "logprobs", False)
        top = _integer(body, "top_logprobs", 0, 0)
        if top and not want:
            raise ValueError("top_logprobs needs logprobs=true")
        logprobs = top if want else None
    else:
        logprobs = _integer(body, "logprobs", None, 0)
    if logprobs is not None and logprobs > MAX_TOP_LOGPROBS:
        raise ValueError(f"top logprobs must be <= {MAX_TOP_LOGPROBS}, got {logprobs}")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an integer, got {seed!r:.200}")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 100.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=max(top_k or 0, 0),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        n=_integer(body, "n", 1, 1) or 1,
        seed=seed,
        stop=_stop_strings(body.get("stop")),
        stop_token_ids=_token_ids(body.get("stop_token_ids"), "stop_token_ids"),
        ignore_eos=_flag(body, "ignore_eos", False),
        include_stop_str_in_output=_flag(body, "include_stop_str_in_output", False),
        skip_special_tokens=_flag(body, "skip_special_tokens", True),
        logprobs=logprobs,
    )


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
    cdf_sv = jnp.cumsum(probs_sv, axis=-1)

    def uniform(key_2: jax.Array, salt: jax.Array, step: jax.Array) -> jax.Array:
        key_2 = jax.random.fold_in(jax.random.fold_in(key_2, salt), step)
        return jax.random.uniform(key_2, (), jnp.float32)

    target_s = jax.vmap(uniform)(keys_s2, salts_s, steps_s) * cdf_sv[:, -1]
    drawn_s = jnp.minimum(jnp.sum(cdf_sv <= target_s[:, None], axis=-1), vocab - 1)
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
