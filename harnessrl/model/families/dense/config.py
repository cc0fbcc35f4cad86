"""Model stage config, dense family: one frozen dataclass for its three HF architectures.

In: a Hugging Face `config.json` dict (or keyword arguments). Out: `ModelConfig`, and back to an
HF config dict for export. Architectures: Llama/SmolLM2, Qwen2 (qkv bias), Qwen3 dense (q/k
RMSNorm).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Published checkpoints' shapes by name, as their HF config.json fields: enough to size a run
# (`harnessrl.learner.plan`) without the weights.
HF_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3-style frequency-dependent RoPE scaling (HF `rope_type: llama3`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder. Defaults are SmolLM2-135M-Instruct in float32."""

    family: str = "llama"  # llama | qwen2 | qwen3
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    # Numerics: params are stored in param_dtype; matmuls run in compute_dtype; norms, softmax and
    # logits always run in float32 so bf16 compute does not drift the loss.
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: bool = False  # recompute each layer's activations in the backward pass
    scan_unroll: int = 1  # layers per iteration of the training forward's layer scan

    def __post_init__(self) -> None:
        if self.family not in ARCHITECTURES:
            raise ValueError(f"family={self.family!r} is not one of {sorted(ARCHITECTURES)}")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {sorted(DTYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads!r} must be positive and divide "
                f"num_heads={self.num_heads!r} (grouped-query attention)"
            )
        if isinstance(self.scan_unroll, bool) or not (
            isinstance(self.scan_unroll, int) and self.scan_unroll >= 1
        ):
            raise ValueError(f"scan_unroll={self.scan_unroll!r} must be a positive integer")
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim!r} must be a positive even integer (RoPE)")

    @property
    def param_jnp_dtype(self) -> Any:
        return DTYPES[self.param_dtype]

    @property
    def compute_jnp_dtype(self) -> Any:
        return DTYPES[self.compute_dtype]

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A few-thousand-parameter model for tests; any field can be overridden."""
        base: dict[str, Any] = dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            rope_theta=10000.0,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], **overrides: Any) -> ModelConfig:
        """Read an HF `config.json` dict (transformers 4.x or 5.x spelling)."""
        family = hf.get("model_type")
        if family not in ARCHITECTURES:
            raise ValueError(
                f"config.json model_type={family!r} is not supported; supported: "
                f"{sorted(ARCHITECTURES)} (Llama/SmolLM2, Qwen2, Qwen3 dense)"
            )
        _reject_unsupported(family, hf)
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(
                f"rope type {rope_type!r} is not supported; supported: 'default', 'llama3'"
            )
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(
                    rope.get("original_max_position_embeddings", hf["max_position_embeddings"])
                ),
            )
        heads = int(hf["num_attention_heads"])
        eos = hf.get("eos_token_id")
        fields: dict[str, Any] = dict(
            family=family,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf_config(self) -> dict[str, Any]:
        """An HF `config.json` dict that transformers and vLLM load."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {"rope_type": "llama3", "rope_theta": self.rope_theta}
            rope.update(dataclasses.asdict(self.rope_scaling))
        hf: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            # Both spellings: transformers 5 reads rope_parameters, 4.x and vLLM read the others.
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "rope_scaling": None if self.rope_scaling is None else rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.param_dtype,
            "dtype": self.param_dtype,
            "use_cache": True,
        }
        if self.family == "llama":
            hf.update(attention_bias=False, mlp_bias=False)
        if self.family == "qwen3":
            hf["attention_bias"] = False
        if self.family in ("qwen2", "qwen3"):
            hf.update(
                use_sliding_window=False, sliding_window=None, max_window_layers=self.num_layers
            )
        return hf


def _reject_unsupported(family: str, hf: dict[str, Any]) -> None:
    """Fail loudly on HF options this decoder does not implement instead of loading wrong math."""
    if family == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise ValueError("Llama config with attention_bias/mlp_bias=True is not supported")
    if family == "qwen3" and hf.get("attention_bias"):
        raise ValueError("Qwen3 config with attention_bias=True is not supported")
    if hf.get("use_sliding_window"):
        raise ValueError("use_sliding_window=True is not supported; full attention only")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported; only 'silu' (SwiGLU)")
