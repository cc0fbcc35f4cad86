"""Model stage: the pure math inside a decoder layer (RMSNorm, RoPE, masks, GQA attention, SwiGLU).

In: activations and one layer's weights as arrays. Out: activations. No parameters live here;
`decoder.py` owns them. Shapes use dimension letters: b batch, t query length, s key length,
d embed, h heads, k kv heads, g query heads per kv head, e head_dim, f mlp.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from harnessrl.model.config import ModelConfig

# A finite "minus infinity": a fully masked query row (padding) then softmaxes to a uniform,
# finite distribution instead of NaN, so padding never poisons gradients.
MASK_VALUE = -1e30


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in (at least) float32 whatever the compute dtype (as HF does)."""
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32 * w.astype(x32.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim/2], with optional llama3-style scaling, in float32 like HF."""
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
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos_bte[:, :, None, :] + rotated * sin_bte[:, :, None, :]
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


def attend(
    q_bthe: jax.Array, k_bske: jax.Array, v_bske: jax.Array, mask_bts: jax.Array
) -> jax.Array:
    """Grouped-query attention; query head h reads kv head h // g (HF `repeat_kv` order)."""
    b, t, h, e = q_bthe.shape
    kv_heads = k_bske.shape[2]
    q_btkge = q_bthe.reshape(b, t, kv_heads, h // kv_heads, e)
    acc = jnp.promote_types(q_bthe.dtype, jnp.float32)
    scores_bkgts = jnp.einsum(
        "btkge,bske->bkgts", q_btkge, k_bske, preferred_element_type=acc
    ) / math.sqrt(e)
    scores_bkgts = jnp.where(mask_bts[:, None, None], scores_bkgts, MASK_VALUE)
    probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1).astype(v_bske.dtype)
    out_btkge = jnp.einsum("bkgts,bske->btkge", probs_bkgts, v_bske)
    return out_btkge.reshape(b, t, h, e)


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
    y = jnp.matmul(x.reshape(-1, k), w.reshape(k, -1), preferred_element_type=out_dtype)
    return y.reshape(*lead, *out)


def swiglu(
    x_btd: jax.Array, w_gate_df: jax.Array, w_up_df: jax.Array, w_down_fd: jax.Array
) -> jax.Array:
    gate_btf = dense(x_btd, w_gate_df)
    up_btf = dense(x_btd, w_up_df)
    return dense(jax.nn.silu(gate_btf) * up_btf, w_down_fd)
