"""Model stage, shared: the activation bytes every decoder layer keeps for its backward pass, per
token, that the learner's memory planner adds up (`harnessrl.learner.plan`).

In: a config's widths, one chip's share of the tensor-split dimensions, the compute dtype's bytes.
Out: bytes per token (or per row) of the residual stream and MLP, and of softmax attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# `per_chip(logical_name, size)`: one dimension's share on a chip under the planned mesh.
PerChip = Callable[[str, int], int]


def stream_bytes(cfg: Any, per_chip: PerChip, c: int) -> int:
    """Residual stream and MLP, every layer kind: 4 d c + 2 d 4 per token (the layer input, the
    normed inputs and the mid residual; the norms in float32) and f (3c + 4) (SwiGLU gate, up,
    their product; the sigmoid in float32)."""
    d, f = cfg.hidden_size, per_chip("mlp", cfg.intermediate_size)
    return 4 * d * c + 2 * d * 4 + f * (3 * c + 4)


def attention_bytes(cfg: Any, per_chip: PerChip, c: int) -> int:
    """Softmax attention per token: (h + 2k) e c + (h + k) e (8 + c) + h e c (q, k, v; the q/k
    norms and RoPE in float32; the output)."""
    h, k = per_chip("heads", cfg.num_heads), per_chip("kv_heads", cfg.num_kv_heads)
    e = cfg.head_dim
    return (h + 2 * k) * e * c + (h + k) * e * (8 + c) + h * e * c


def score_bytes(cfg: Any, per_chip: PerChip, b: int, t: int, c: int) -> tuple[int, int]:
    """(kept, masked) of the attention scores: b h t^2 (4 + c) (the softmax output in float32 and
    compute dtype; a layer's backward adds the same again), and the masked scores in float32,
    b h t^2 4, which only a fully kept forward (no remat) holds."""
    h = per_chip("heads", cfg.num_heads)
    return b * h * t * t * (4 + c), b * h * t * t * 4
