"""Model stage: bfloat16 weights held as their raw 16-bit words, widened to float32 where read.

A decode step is bound by the bytes of weights it streams, so serving from bfloat16 halves its
memory traffic. XLA:CPU converts a `bfloat16` array several times slower than it streams the
float32 one, though, which would lose more than it saves. So the serving engine keeps bfloat16
weights as `uint16` words and widens them with an integer shift (`widen`): exact, since a
bfloat16 is the top half of a float32, and cheap enough to fuse into the copy of each layer's
slice that the layer scan makes anyway. Arithmetic stays float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BITS_DTYPE = jnp.uint16


@jax.jit
def to_bits(x: jax.Array) -> jax.Array:
    """float32 (or any float) → its bfloat16 rounding (to nearest, ties to even) as uint16 words.

    Integer arithmetic on the float32 bits, so it runs at memory speed on every backend; NaN stays
    a quiet NaN and infinities stay infinite, as `astype(jnp.bfloat16)` would give.
    """
    u_32 = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    rounded_32 = (u_32 + 0x7FFF + ((u_32 >> 16) & 1)) >> 16
    nan_16 = ((u_32 >> 16) | 0x0040).astype(BITS_DTYPE)  # keep the sign, set the quiet bit
    return jnp.where(jnp.isnan(x), nan_16, rounded_32.astype(BITS_DTYPE))


def widen(w: jax.Array) -> jax.Array:
    """Weights as float32: uint16 words are widened bit-exactly; anything else passes through."""
    if w.dtype != BITS_DTYPE:
        return w
    return jax.lax.bitcast_convert_type(w.astype(jnp.uint32) << 16, jnp.float32)


def is_bits(w: jax.Array) -> bool:
    return bool(w.dtype == BITS_DTYPE)
