"""Model stage: the pure math inside a decoder layer (RMSNorm, RoPE, masks, GQA attention, SwiGLU).

In: activations and one layer's weights as arrays. Out: activations. No parameters live here;
`decoder.py` owns them. Shapes use dimension letters: b batch, t query length, s key length,
d embed, h heads, k kv heads, g query heads per kv head, e head_dim, f mlp.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

# A finite "minus infinity": a fully masked query row (padding) then softmaxes to a uniform,
# finite distribution instead of NaN, so padding never poisons gradients.
MASK_VALUE = -1e30

# Every dot, einsum and matmul of the model states its precision: the operands' dtype (the
# config's compute_dtype, or float32 where a step always runs in float32) is what gets multiplied,
# on every backend. A backend's default would round float32 operands first: to TF32 on NVIDIA
# GPUs since Ampere, to one bfloat16 pass on TPU; CPUs multiply float32 as float32 anyway. For
# bfloat16 operands HIGHEST is the bf16 product itself: there is nothing finer to round to.
PRECISION = jax.lax.Precision.HIGHEST


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in (at least) float32 whatever the compute dtype (as HF does)."""
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32 * w.astype(x32.dtype)


def rope_inv_freq(cfg: Any) -> np.ndarray:
    """Inverse frequencies [head_dim/2], with optional llama3-style scaling, in float32 like HF.

    `cfg` is any family's config with `head_dim`, `rope_theta` and `rope_scaling` (None, or a
    `RopeScaling` of the dense family's config)."""
    dim = cfg.head_dim
    # Bit-identical to HF's float32 computation: float32 exponents, the power rounded once to
    # float32, then a float32 reciprocal (numpy's float32 pow is off by up to 2 ulp from it).
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    power = (np.float64(cfg.rope_theta) ** exponent.astype(np.float64)).astype(np.float32)
    inv_freq = np.float32(1.0) / power
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated.
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions_bt: jax.Array, inv_freq_e2: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin [b, t, head_dim] for each token's own position (HF half-split layout)."""
    angles_bte2 = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_e2)
    angles_bte = jnp.concatenate([angles_bte2, angles_bte2], axis=-1)
    return jnp.cos(angles_bte), jnp.sin(angles_bte)


def apply_rope(x_bthe: jax.Array, cos_bte: jax.Array, sin_bte: jax.Array) -> jax.Array:
    """Rotate pairs (i, i + head_dim/2) by the position angle; computed in (at least) float32."""
    x32 = x_bthe.astype(jnp.promote_types(x_bthe.dtype, jnp.float32))
    half = x32.shape[-1] // 2
    first, second = x32[..., :half], x32[..., half:]
    # The tables repeat their first half (HF's layout), so each output half reads one half of
    # them: the same products as `x * cos + rotate_half(x) * sin`, without materializing the
    # rotated copy (its concatenate cost XLA:CPU a separate pass, forward and backward).
    cos_bt1e, sin_bt1e = cos_bte[:, :, None, :half], sin_bte[:, :, None, :half]
    out = jnp.concatenate(
        [first * cos_bt1e - second * sin_bt1e, second * cos_bt1e + first * sin_bt1e], axis=-1
    )
    return out.astype(x_bthe.dtype)


def segment_causal_mask(segment_ids_bt: jax.Array) -> jax.Array:
    """[b, t, t] True where query i may see key j: same segment and j <= i (row order)."""
    t = segment_ids_bt.shape[1]
    causal_tt = jnp.tril(jnp.ones((t, t), dtype=bool))
    same_btt = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
    return same_btt & causal_tt[None]


def cache_mask(positions_bt: jax.Array, cache_len: int) -> jax.Array:
    """[b, t, s] True where a query at position p may see cache slot s: 0 <= s <= p.

    Padding queries (p < 0) see nothing; their outputs are finite garbage to be ignored.
    """
    slots_s = jnp.arange(cache_len, dtype=positions_bt.dtype)
    return slots_s[None, None, :] <= positions_bt[:, :, None]


# Causal attention skips the key blocks above the diagonal: the query rows split into up to
# MAX_QUERY_BLOCKS blocks of at least MIN_QUERY_BLOCK rows, each attending only to the keys up to
# its last row. At 4 blocks that is 5/8 of the score work; each block costs a few more ops, and
# the learner unrolls every layer on CPU, so their number stays small.
MAX_QUERY_BLOCKS = 8
MIN_QUERY_BLOCK = 64


def causal_query_blocks(length: int) -> int:
    """How many query blocks `attend(..., causal_blocks=)` splits `length` rows into."""
    for blocks in range(MAX_QUERY_BLOCKS, 1, -1):
        if length % blocks == 0 and length // blocks >= MIN_QUERY_BLOCK:
            return blocks
    return 1


def attend(
    q_bthe: jax.Array,
    k_bske: jax.Array,
    v_bske: jax.Array,
    mask_bts: jax.Array,
    *,
    causal_blocks: int = 1,
) -> jax.Array:
    """Grouped-query attention; query head h reads kv head h // g (HF `repeat_kv` order).

    Query heads are laid out `[b, k, g·t, e]`, so each kv head's g query heads are one
    batched matmul against its keys (no repeated k/v, no transposes around the dots), and
    the backward pass is written by hand (`_attention_bwd`) with the fewest passes over the
    `[b, h, t, s]` scores.

    `causal_blocks` > 1 (see `causal_query_blocks`) is for a causal mask over the same tokens
    (s == t, no query sees a later key, as `segment_causal_mask` gives): the query rows split into
    that many blocks, and each block scores only the keys up to its own last row, which the mask
    would have hidden from it anyway.
    """
    b, t, h, e = q_bthe.shape
    kv_heads, g = k_bske.shape[2], h // k_bske.shape[2]
    if t % causal_blocks or (causal_blocks > 1 and k_bske.shape[1] != t):
        raise ValueError(
            f"causal_blocks={causal_blocks} needs as many keys as queries and queries ({t}) "
            "divisible by it; use causal_query_blocks(length)"
        )
    q_bkgte = q_bthe.reshape(b, t, kv_heads, g, e).transpose(0, 2, 3, 1, 4)
    k_bkse, v_bkse = k_bske.transpose(0, 2, 1, 3), v_bske.transpose(0, 2, 1, 3)
    rows = t // causal_blocks
    blocks_bkgte = []
    for block in range(causal_blocks):
        first, end = block * rows, (block + 1) * rows
        keys = end if causal_blocks > 1 else k_bkse.shape[2]
        q_bkme = q_bkgte[:, :, :, first:end].reshape(b, kv_heads, g * rows, e)
        out_bkme = _attention(
            q_bkme, k_bkse[:, :, :keys], v_bkse[:, :, :keys], mask_bts[:, first:end, :keys]
        )
        blocks_bkgte.append(out_bkme.reshape(b, kv_heads, g, rows, e))
    out_bkgte = jnp.concatenate(blocks_bkgte, axis=3) if causal_blocks > 1 else blocks_bkgte[0]
    return out_bkgte.transpose(0, 3, 1, 2, 4).reshape(b, t, h, e)


def _probs(q_bkme: jax.Array, k_bkse: jax.Array, mask_bts: jax.Array) -> jax.Array:
    """Softmax over keys of the scaled scores, masked to MASK_VALUE, in (at least) float32."""
    b, kv_heads, m, e = q_bkme.shape
    t, s = mask_bts.shape[1:]
    acc = jnp.promote_types(q_bkme.dtype, jnp.float32)
    scores_bkms = jnp.einsum(
        "bkme,bkse->bkms", q_bkme, k_bkse, precision=PRECISION, preferred_element_type=acc
    )
    scores_bkgts = scores_bkms.reshape(b, kv_heads, m // t, t, s) / math.sqrt(e)
    scores_bkgts = jnp.where(mask_bts[:, None, None], scores_bkgts, MASK_VALUE)
    return jax.nn.softmax(scores_bkgts, axis=-1).reshape(b, kv_heads, m, s)


@jax.custom_vjp
def _attention(
    q_bkme: jax.Array, k_bkse: jax.Array, v_bkse: jax.Array, mask_bts: jax.Array
) -> jax.Array:
    probs_bkms = _probs(q_bkme, k_bkse, mask_bts).astype(v_bkse.dtype)
    return jnp.einsum("bkms,bkse->bkme", probs_bkms, v_bkse, precision=PRECISION)


def _attention_fwd(
    q_bkme: jax.Array, k_bkse: jax.Array, v_bkse: jax.Array, mask_bts: jax.Array
) -> tuple[jax.Array, tuple]:
    probs_bkms = _probs(q_bkme, k_bkse, mask_bts).astype(v_bkse.dtype)
    out_bkme = jnp.einsum("bkms,bkse->bkme", probs_bkms, v_bkse, precision=PRECISION)
    return out_bkme, (q_bkme, k_bkse, v_bkse, mask_bts, probs_bkms, out_bkme)


def _attention_bwd(residuals: tuple, d_out_bkme: jax.Array) -> tuple:
    """Softmax backward as flash attention does it: rowsum(dP * P) equals rowsum(dO * O).

    That row sum is taken over head_dim instead of over every key, so the only passes over
    the scores-sized arrays are the two dots that make dP and consume dS, and one fused
    elementwise pass between them. Autodiff of the softmax added a reduction over the
    scores, and of the mask a select, each a full pass.
    """
    q_bkme, k_bkse, v_bkse, mask_bts, probs_bkms, out_bkme = residuals
    b, kv_heads, m, e = q_bkme.shape
    t, s = mask_bts.shape[1:]
    acc = jnp.promote_types(q_bkme.dtype, jnp.float32)
    d_v_bkse = jnp.einsum("bkms,bkme->bkse", probs_bkms, d_out_bkme, precision=PRECISION)
    d_probs_bkms = jnp.einsum(
        "bkme,bkse->bkms", d_out_bkme, v_bkse, precision=PRECISION, preferred_element_type=acc
    )
    row_bkm1 = jnp.sum(d_out_bkme.astype(acc) * out_bkme.astype(acc), axis=-1, keepdims=True)
    d_scores_bkms = probs_bkms.astype(acc) * (d_probs_bkms - row_bkm1)
    # Masked scores are constants: no gradient, also for fully masked (padding) rows.
    d_scores_bkgts = jnp.where(
        mask_bts[:, None, None], d_scores_bkms.reshape(b, kv_heads, m // t, t, s), 0.0
    )
    d_scores_bkms = (d_scores_bkgts / math.sqrt(e)).reshape(b, kv_heads, m, s)
    d_scores_bkms = d_scores_bkms.astype(q_bkme.dtype)
    d_q_bkme = jnp.einsum("bkms,bkse->bkme", d_scores_bkms, k_bkse, precision=PRECISION)
    d_k_bkse = jnp.einsum("bkms,bkme->bkse", d_scores_bkms, q_bkme, precision=PRECISION)
    return d_q_bkme, d_k_bkse, d_v_bkse, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def dense(
    x: jax.Array, w: jax.Array, contract: int = 1, out_dtype: DTypeLike | None = None
) -> jax.Array:
    """Contract the last `contract` axes of `x` with the first ones of `w`, as one 2-D matmul.

    `dense(x_btd, w_dhe)` is `einsum("btd,dhe->bthe")`. Flattening [b, t] (and the weight's
    output axes) first gives the backward pass plain 2-D dots: for the same einsum over [b, t],
    XLA's CPU backend transposes and copies every activation gradient before the weight-gradient
    dot, which made a SwiGLU MLP's backward 1.7x slower.
    """
    k = math.prod(w.shape[:contract])
    lead, out = x.shape[: x.ndim - contract], w.shape[contract:]
    y = jnp.matmul(
        x.reshape(-1, k), w.reshape(k, -1), precision=PRECISION, preferred_element_type=out_dtype
    )
    return y.reshape(*lead, *out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def tied_head_logits(h_btd: jax.Array, embed_vd: jax.Array, out_dtype: DTypeLike) -> jax.Array:
    """Logits through a tied embedding: `dense(h_btd, embed_vd.T)`, with its own VJP.

    Autodiff makes the embedding's gradient one dot that writes `[vocab, embed]` from the
    transposed `[tokens, vocab]` logit gradient. XLA's CPU backend runs that orientation slower
    than the `[embed, vocab]` product followed by a transpose, and folds any transpose written
    after the dot back into it. So the backward pass computes the `[embed, vocab]` product behind
    an optimization barrier and transposes it after. The values are the same dots'; the forward
    pass, which serving runs too, is untouched.
    """
    return dense(h_btd, embed_vd.T, out_dtype=out_dtype)


def _tied_head_fwd(
    h_btd: jax.Array, embed_vd: jax.Array, out_dtype: DTypeLike
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return tied_head_logits(h_btd, embed_vd, out_dtype), (h_btd, embed_vd)


def _tied_head_bwd(
    out_dtype: DTypeLike, residuals: tuple[jax.Array, jax.Array], d_logits_btv: jax.Array
) -> tuple[jax.Array, jax.Array]:
    h_btd, embed_vd = residuals
    d = h_btd.shape[-1]
    d_logits_nv = d_logits_btv.reshape(-1, embed_vd.shape[0])
    d_h_btd = dense(d_logits_btv, embed_vd, out_dtype=out_dtype).astype(h_btd.dtype)
    d_head_dv = jax.lax.dot_general(
        h_btd.reshape(-1, d),
        d_logits_nv,
        (((0,), (0,)), ((), ())),
        precision=PRECISION,
        preferred_element_type=out_dtype,
    )
    d_embed_vd = jax.lax.optimization_barrier(d_head_dv).T.astype(embed_vd.dtype)
    return d_h_btd, d_embed_vd


tied_head_logits.defvjp(_tied_head_fwd, _tied_head_bwd)


def swiglu(
    x_btd: jax.Array, w_gate_df: jax.Array, w_up_df: jax.Array, w_down_fd: jax.Array
) -> jax.Array:
    gate_btf = dense(x_btd, w_gate_df)
    up_btf = dense(x_btd, w_up_df)
    return dense(jax.nn.silu(gate_btf) * up_btf, w_down_fd)
