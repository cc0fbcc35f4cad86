"""Model stage, shared: the kernels a runtime may hand a decoder, and XLA's segment attention.

In: a serving runtime's decode kernels (`harnessrl.engine.cpu_kernels`) or a learner's training
attention (`harnessrl.kernels.train_attention`). Out: the call signatures a family's decoder
accepts them with (`decode(..., kernels=)`, `__call__(..., attention=)`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax

from harnessrl.model import attention as attn

# `matvec(x_rk, w_lkn, layer, transposed)` → `x_rk @ w_lkn[layer]` (`@ w_lnk[layer].T` if
# transposed) as float32: a serving runtime's kernel for few-row matmuls that reads one layer's
# weights (float32, or bfloat16 words) in place from the stacked array (harnessrl.engine.cpu_kernels).
MatVec = Callable[..., jax.Array]


class DecodeKernels(NamedTuple):
    """A serving runtime's kernels for decode steps (one token per cache slot).

    `matvec` (see `MatVec`) computes every projection and the head; `attention(q_she, k_lsmke,
    v_lsmke, layer, positions_s)` attends each slot's query over that slot's cache positions
    `0..positions_s[s]` of layer `layer`, read in place (`[slots, heads, head_dim]` out).
    """

    matvec: MatVec
    attention: Callable[..., jax.Array]


# `attention(q_bthe, k_btke, v_btke, segment_ids_bt)` → `[b, t, heads, head_dim]`: each query over
# the keys at or before it in its own segment, grouped-query heads as `attention.attend` reads
# them. The learner passes its CPU kernel (harnessrl.kernels.train_attention) where it applies.
SegmentAttention = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def masked_attention(segment_ids_bt: jax.Array) -> SegmentAttention:
    """`SegmentAttention` as XLA ops: `attention.attend` over the causal mask within segments."""
    mask_btt = attn.segment_causal_mask(segment_ids_bt)
    blocks = attn.causal_query_blocks(segment_ids_bt.shape[1])
    return lambda q, k, v, _: attn.attend(q, k, v, mask_btt, causal_blocks=blocks)
