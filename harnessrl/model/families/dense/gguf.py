"""Model stage, dense family: GGUF files → HF-named float32 tensors and a `ModelConfig`.

In: an open GGUF file of the llama, qwen2 or qwen3 architecture (any quantization the `gguf`
package can dequantize, e.g. Q4_1, Q8_0, F16) and its metadata. Out: a `ModelConfig` and tensors
with HF names, so the same mapping as HF folders (`hf.params_from_hf`) turns them into decoder
parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from harnessrl.model.families.dense.config import ModelConfig

SUPPORTED = ("llama", "qwen2", "qwen3")

# GGUF tensor name (after "blk.N.") → HF name (after "model.layers.N.").
LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
TOP_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def config_from_metadata(meta: dict[str, Any], has_output: bool) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {SUPPORTED}")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    if meta.get(f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise ValueError("GGUF rope scaling is not supported; import the HF folder instead")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return ModelConfig(
        family=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        # Stored as float32; the shortest decimal (1e-05, not 9.99e-06) is what the HF config says.
        rms_norm_eps=float(str(np.float32(get("attention.layer_norm_rms_epsilon")))),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings=not has_output,
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs → HF's half-split layout)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(
    reader: GGUFReader, meta: dict[str, Any]
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and every tensor dequantized to float32 numpy with HF names and layouts, from an
    open file and its metadata (`harnessrl.model.formats.gguf.read_metadata`)."""
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(
            f"{Path(str(reader.data.filename)).name}: GGUF rope_freqs (llama3 rope scaling) is not supported"
        )
    cfg = config_from_metadata(meta, has_output="output.weight" in names)
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        hf_name = _hf_name(t.name)
        # dequantize gives [rows, cols] = GGUF shape reversed = HF [out, in].
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(n) for n in reversed(t.shape)])
        if cfg.family == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            n = cfg.num_heads if "q_proj" in hf_name else cfg.num_kv_heads
            w = unpermute_rope(w, n)
        tensors[hf_name] = w
    return cfg, tensors


def _hf_name(name: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    raise ValueError(f"GGUF tensor {name!r} has no known HF equivalent")
