"""The learner's attention on CPU: causal grouped-query attention within packed segments, in C++.

`segment_attention(q_bthe, k_btke, v_btke, segment_ids_bt)` equals
`attention.attend(q, k, v, attention.segment_causal_mask(segment_ids_bt))` up to float32
summation order, forward and backward, for float32 arrays with head_dim a multiple of 64. Its
forward saves each query's log-sum-exp and its backward recomputes the probabilities from it, as
flash attention does, so no `[b, heads, t, t]` array is ever stored; both skip the keys a query's
segment hides (train_attention.cc says why that beats XLA's dots here). `usable()` tells whether
it applies to a model and backend; the learner then passes it to the decoder
(`Decoder.__call__(..., attention=)`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from harnessrl.kernels import build

FORWARD = "harnessrl_attention_fwd"
BACKWARD = "harnessrl_attention_bwd"
HEAD_DIM_MULTIPLE = 64  # the kernel holds 64 lanes of head_dim per query row in registers


def usable(head_dim: int, compute_dtype: str, backend: str | None = None) -> bool:
    """True where the kernel serves this shape and dtype on this backend (and it has built)."""
    return head_dim % HEAD_DIM_MULTIPLE == 0 and compute_dtype == "float32" and build.load(backend)


def _forward_call(
    q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """→ (out `[b, t, h, e]`, each query's log-sum-exp `[b, t, h]`)."""
    b, t, h, _ = q.shape
    call = jax.ffi.ffi_call(
        FORWARD,
        (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct((b, t, h), jnp.float32)),
    )
    out, lse = call(q, k, v, _columns(k), seg)
    return out, lse


def _columns(x_btke: jax.Array) -> jax.Array:
    """`[b, kv_heads, e, t]`: each key a column, so the kernel scores 16 keys per vector."""
    return x_btke.transpose(0, 2, 3, 1)


@jax.custom_vjp
def segment_attention(
    q_bthe: jax.Array, k_btke: jax.Array, v_btke: jax.Array, segment_ids_bt: jax.Array
) -> jax.Array:
    """Attention of each query over the keys at or before it in its own segment → `[b, t, h, e]`."""
    out, _ = _forward_call(*_operands(q_bthe, k_btke, v_btke, segment_ids_bt))
    return out


def _operands(
    q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    if q.shape[-1] % HEAD_DIM_MULTIPLE or k.shape != v.shape or q.shape[:2] != seg.shape:
        raise ValueError(
            f"segment_attention needs q [b, t, h, e] with e a multiple of {HEAD_DIM_MULTIPLE}, k "
            f"and v alike [b, t, kv_heads, e] and segment_ids [b, t]; got q {q.shape}, k "
            f"{k.shape}, v {v.shape}, segment_ids {seg.shape}"
        )
    f32 = jnp.float32
    return q.astype(f32), k.astype(f32), v.astype(f32), seg.astype(jnp.int32)


def _fwd(
    q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    operands = _operands(q, k, v, seg)
    out, lse = _forward_call(*operands)
    return out, (*operands, out, lse)


def _bwd(residuals: tuple[jax.Array, ...], d_out: jax.Array) -> tuple[jax.Array | None, ...]:
    q, k, v, seg, out, lse = residuals
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    d_q, d_k, d_v = jax.ffi.ffi_call(BACKWARD, shapes)(
        q, k, v, _columns(k), _columns(v), seg, out, lse, d_out.astype(jnp.float32)
    )
    return d_q, d_k, d_v, None


segment_attention.defvjp(_fwd, _bwd)
