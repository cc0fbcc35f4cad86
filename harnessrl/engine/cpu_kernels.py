"""Engine stage, CPU kernels: a decode step's matmuls and attention in C++, read in place.

`matvec`: activation rows `[rows, k]` float32 times layer `i` of a stacked weight `[layers, k, n]`
(or `[layers, n, k]`), float32 or bfloat16 words (`model.bf16_bits`) → `[rows, n]` float32.
`decode_attention`: one query per cache slot against that slot's own cache positions → `[slots,
heads, head_dim]`. The C++ (`harnessrl/kernels/decode.cc`) is built and registered by
`harnessrl.kernels.build.load()`, re-exported here, which returns False where it cannot run (no
compiler, not an x86-64 CPU backend); the decoder then keeps XLA's ops. See docs/serve.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from harnessrl.kernels.build import load
from harnessrl.model.hooks import DecodeKernels

__all__ = ["KERNELS", "MAX_SLOTS", "decode_attention", "load", "matvec"]

TARGET = "harnessrl_matvec"
ATTENTION_TARGET = "harnessrl_decode_attention"
# Slots the engine sends through the kernels: beyond 8 rows the matmul re-reads each weight per
# group of 8, and it still beat XLA's dots at 16 and 32 (docs/serve.md); larger is not measured.
MAX_SLOTS = 32


def matvec(x_rk: jax.Array, w_lkn: jax.Array, layer: jax.Array, transposed: bool) -> jax.Array:
    """`x_rk @ w_lkn[layer]` (`x_rk @ w_lnk[layer].T` if `transposed`), float32 `[rows, n]`.

    Needs `load()` to have returned True. The weights are read in place from the stacked array.
    """
    n = w_lkn.shape[1] if transposed else w_lkn.shape[2]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x_rk.shape[0], n), jnp.float32))
    return call(
        x_rk.astype(jnp.float32), w_lkn, jnp.asarray(layer, jnp.int32), transposed=transposed
    )


def decode_attention(
    q_she: jax.Array,
    k_lsmke: jax.Array,
    v_lsmke: jax.Array,
    layer: jax.Array,
    positions_s: jax.Array,
) -> jax.Array:
    """One query per cache slot against that slot's cache positions `0..positions_s[s]` of layer
    `layer` (float32 caches), read in place; grouped-query heads as `attention.attend`. A slot at
    position -1 gets zeros. → `[slots, heads, head_dim]` float32."""
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q_she.shape, jnp.float32))
    return call(
        q_she.astype(jnp.float32),
        k_lsmke,
        v_lsmke,
        jnp.asarray(layer, jnp.int32),
        positions_s.astype(jnp.int32),
    )


KERNELS = DecodeKernels(matvec=matvec, attention=decode_attention)
