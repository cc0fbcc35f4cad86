"""Model stage, Qwen3.5 family: what each layer kind keeps for its backward pass, for the planner.

In: a `Qwen35Config`, a chip's share of each dimension, rows b, length t, compute bytes c.
Out: `(count, A, A', B)` per layer kind (`harnessrl.learner.plan.activation_bytes`).
"""

from __future__ import annotations

from harnessrl.model.families.qwen3_5.config import Qwen35Config
from harnessrl.model.memory import PerChip, attention_bytes, score_bytes, stream_bytes


def layer_kinds(
    cfg: Qwen35Config, per_chip: PerChip, b: int, t: int, c: int
) -> list[tuple[int, int, int, int]]:
    """Gated attention: softmax attention (`harnessrl.model.memory`) plus its gate (h e (c + 4)).

    Gated DeltaNet layers keep, per token, the conv's W shifted inputs and float32 outputs
    (2 r k + h_v v)(W c + 8), the gate z (h_v v c), the float32 queries and keys (normalized,
    repeated to the value heads, chunked, beta-scaled, decayed, and the scan's copies) and values
    (chunked, beta-scaled, the solved u, the corrected v, the output and its norm): 14 h_v k 4 +
    10 h_v v 4; the chunk's masks, decays, A, (I + A) and intra-chunk scores, 8 h_v C 4 for chunk
    C; and the state carried into each chunk, h_v k v 4 / C. B is one set of the chunk matrices.
    These coefficients count the float32 copies XLA keeps of `chunked_gated_delta_rule`.
    """
    stream, attention = stream_bytes(cfg, per_chip, c), attention_bytes(cfg, per_chip, c)
    scores, masked = score_bytes(cfg, per_chip, b, t, c)
    h, e = per_chip("heads", cfg.num_heads), cfg.head_dim
    gate = h * e * (c + 4)
    full = (cfg.num_groups, b * t * (stream + attention + gate) + scores, masked, scores)
    r = per_chip("kv_heads", cfg.linear_num_key_heads)
    hv = per_chip("heads", cfg.linear_num_value_heads)
    kd, vd, chunk = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.chunk_size
    width = cfg.linear_conv_kernel_dim
    mixer = (2 * r * kd + hv * vd) * (width * c + 8) + hv * vd * c
    mixer += 14 * hv * kd * 4 + 10 * hv * vd * 4
    chunks = 8 * hv * chunk * 4
    state = hv * kd * vd * 4 // chunk
    linear = (cfg.num_linear_layers, b * t * (stream + mixer + chunks + state), 0, b * t * chunks)
    return [full, linear]
