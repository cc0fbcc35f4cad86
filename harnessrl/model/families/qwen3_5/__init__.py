"""Model stage: the Qwen3.5 text decoder, a hybrid of Gated DeltaNet and gated attention layers.

In: a `Qwen35Config` (from a `qwen3_5` / `qwen3_5_text` `config.json`) and token ids, positions
and segment ids `[b, t]`. Out: float32 logits `[b, t, vocab]`; HF safetensors in and out.

The recipe, as transformers 5.x's `qwen3_5` modeling code computes it (its `qwen3_next` parent
differs only where noted):

* Layers. `layer_types[i]` is `full_attention` when `(i + 1) % full_attention_interval == 0`
  (interval 4: three Gated DeltaNet layers, then one attention layer), else `linear_attention`.
  Every layer is pre-norm: `x += mixer(norm1(x)); x += swiglu_mlp(norm2(x))`.
* Norms. Block, final and q/k norms are zero-centred RMSNorms: `rms(x) * (1 + w)`, `w` stored
  around 0 (initialised to zeros), computed in float32. The one exception is the gated norm at
  the end of a DeltaNet layer: a plain `rms(o) * w` (w around 1), shared by all value heads,
  times `silu(z)`.
* Gated attention layer. `q_proj` yields `2 * head_dim` per head: the first half is the query,
  the second an output gate. q and k get the zero-centred RMSNorm over head_dim, then RoPE on
  the first `head_dim * partial_rotary_factor` dims only (0.25 by default; half-split rotation
  within those dims; text positions make the multimodal mRoPE sections coincide, so it is plain
  RoPE), GQA softmax attention scaled by `head_dim**-0.5`, then `out * sigmoid(gate)` before
  `o_proj`. No biases.
* Gated DeltaNet layer. `in_proj_qkv` gives q, k (`linear_num_key_heads` x `linear_key_head_dim`)
  and v (`linear_num_value_heads` x `linear_value_head_dim`) as one channel block that runs
  through a causal depthwise conv1d (kernel `linear_conv_kernel_dim` = 4, no bias) and SiLU.
  `in_proj_z` gives the output gate z (value-shaped), `in_proj_b` beta = sigmoid(b) and
  `in_proj_a` the decay `g = -exp(A_log) * softplus(a + dt_bias)` per value head. q and k are
  L2-normalised (`x * rsqrt(sum x^2 + 1e-6)`) and q is scaled by `key_head_dim**-0.5`; value head
  h reads key head `h // (value_heads / key_heads)`. The gated delta rule per head, state S
  `[key_dim, value_dim]`: `S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t`.
  Training runs it chunked (the WY/UT form: a unit-lower-triangular solve per chunk, a scan over
  chunks); decoding runs it one token at a time. (`qwen3_next` packs q, k, v, z in one
  head-interleaved `in_proj_qkvz` and b, a in `in_proj_ba`; the math is the same.)
* Embeddings. `tie_word_embeddings` comes from the config (False for the large checkpoints).
* Multi-token prediction. Checkpoints carry `mtp.*` tensors (one extra attention layer that
  predicts token t+2 from the trunk's state and token t+1's embedding). transformers ignores them
  at load and so do we: the RL loss is on the next-token log-likelihood of tokens the server
  sampled from the main head (MTP only drafts for speculative decoding, which leaves the sampled
  distribution unchanged), so it adds nothing to the policy gradient; training it would need a
  second objective. The export is the text model; a server that wants MTP drafts keeps the
  original checkpoint's `mtp.*` tensors (their acceptance rate falls as the trunk moves).

Packed rows: the recurrent state and the conv window restart wherever the segment id changes, so a
packed row computes exactly what each sequence computes alone; attention layers use the
segment-causal mask. Parameters carry logical axis names (`harnessrl.model.sharding`): the DeltaNet
key heads are `kv_heads`, its value heads `heads`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from gguf import GGUFReader

from harnessrl.model.families.qwen3_5 import hf, memory
from harnessrl.model.families.qwen3_5.cache import HybridCache
from harnessrl.model.families.qwen3_5.config import MODEL_TYPES, Qwen35Config
from harnessrl.model.families.qwen3_5.decoder import Qwen35Decoder

__all__ = ["FAMILY", "Qwen35Config", "Qwen35Decoder"]

# Random Qwen3.5-family policies around SmolLM2's tokenizer: a tiny one for tests, and one of
# SmolLM2-135M's width and depth (rounded to whole groups of four layers).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny-qwen3_5": dict(
        hidden_size=32, intermediate_size=64, num_layers=4, full_attention_interval=2,
        num_heads=4, num_kv_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, chunk_size=8,
    ),
    "smollm2-qwen3_5": dict(
        hidden_size=576, intermediate_size=1536, num_layers=28, num_heads=9, num_kv_heads=3,
        head_dim=64, linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=64,
        linear_value_head_dim=64,
    ),
    # Qwen3.5-9B's text widths (Qwen35Config's defaults) at one group: 3 DeltaNet + 1 attention
    # layer, for measuring the per-layer cost (benchmarks.model --family qwen3_5 --layers N).
    "qwen3_5-9b-shape": dict(num_layers=4),
}  # fmt: skip


class Qwen35:
    name = "qwen3_5"
    label = "Qwen3.5"
    model_types = MODEL_TYPES
    gguf_architectures: tuple[str, ...] = ()
    config = Qwen35Config
    decoder = Qwen35Decoder
    cache = HybridCache
    recurrent = True
    serves_bf16_weights = False
    decode_kernels = False
    segment_attention = False
    # Each layer holds a scan over chunks: unrolled, 28 layers took 3.6x longer to compile on
    # CPU (305 s vs 84 s) and ran slower (18.6 s vs 12.7 s a step).
    unroll_layers_on_cpu = False
    shapes: Mapping[str, Mapping[str, Any]] = SHAPES
    random_specs = tuple(SHAPES)
    planned_shapes: ClassVar[Mapping[str, Callable[[], Any]]] = {
        "qwen3_5-9b": Qwen35Config
    }  # the defaults are Qwen3.5-9B's text model

    def random_config(self, spec: str, vocab_size: int) -> Qwen35Config:
        return Qwen35Config(
            **SHAPES[spec],
            vocab_size=vocab_size,
            rope_theta=100000.0,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        )

    def params_from_hf(self, cfg: Qwen35Config, tensors: Mapping[str, np.ndarray]) -> hf.Params:
        return hf.params_from_hf(cfg, tensors)

    def hf_from_params(self, cfg: Qwen35Config, params: hf.Params) -> dict[str, np.ndarray]:
        return hf.hf_from_params(cfg, params)

    def read_hf_folder(self, path: Path) -> tuple[Qwen35Config, dict[str, np.ndarray]]:
        return hf.read_hf_folder(path)

    def read_gguf(self, reader: GGUFReader, meta: dict[str, Any]) -> tuple[Qwen35Config, Any]:
        raise ValueError("the Qwen3.5 family reads HF folders, not GGUF files")

    def layer_kinds(
        self, cfg: Qwen35Config, per_chip: memory.PerChip, b: int, t: int, c: int
    ) -> list[tuple[int, int, int, int]]:
        return memory.layer_kinds(cfg, per_chip, b, t, c)


FAMILY = Qwen35()
