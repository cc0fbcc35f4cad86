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

from harnessrl.model.qwen3_5.config import Qwen35Config
from harnessrl.model.qwen3_5.decoder import Qwen35Decoder

__all__ = ["Qwen35Config", "Qwen35Decoder"]
