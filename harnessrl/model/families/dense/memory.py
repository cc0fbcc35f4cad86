"""Model stage, dense family: what one layer keeps for its backward pass, for the memory planner.

In: a `ModelConfig`, a chip's share of each dimension, rows b, length t, compute bytes c.
Out: `(count, A, A', B)` per layer kind (`harnessrl.learner.plan.activation_bytes`).
"""

from __future__ import annotations

from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.memory import PerChip, attention_bytes, score_bytes, stream_bytes


def layer_kinds(
    cfg: ModelConfig, per_chip: PerChip, b: int, t: int, c: int
) -> list[tuple[int, int, int, int]]:
    """One kind: every layer is softmax attention and a SwiGLU MLP (`harnessrl.model.memory`)."""
    stream, attention = stream_bytes(cfg, per_chip, c), attention_bytes(cfg, per_chip, c)
    scores, masked = score_bytes(cfg, per_chip, b, t, c)
    return [(cfg.num_layers, b * t * (stream + attention) + scores, masked, scores)]
