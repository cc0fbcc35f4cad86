"""Model stage config for the Qwen3.5 family: one frozen dataclass, to and from HF `config.json`.

In: a `qwen3_5_text` config dict, or a `qwen3_5` one (its `text_config` is read). Out:
`Qwen35Config`, and back to a `qwen3_5_text` dict that transformers' `Qwen3_5ForCausalLM` loads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
MODEL_TYPES = ("qwen3_5_text", "qwen3_5")


@dataclasses.dataclass(frozen=True)
class Qwen35Config:
    """Shape and numerics of a Qwen3.5 text decoder. Defaults are Qwen3.5-9B's text model."""

    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_layers: int = 32
    full_attention_interval: int = 4  # every 4th layer is softmax attention, the rest DeltaNet
    # Gated attention layers.
    num_heads: int = 16
    num_kv_heads: int = 4
    head_dim: int = 256
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    # Gated DeltaNet layers.
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    chunk_size: int = 64  # tokens per chunk of the chunked delta rule (a static shape)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: bool = False  # recompute each layer's activations in the backward pass
    scan_unroll: int = 1  # layers per iteration of the training forward's layer scans

    def __post_init__(self) -> None:
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {sorted(DTYPES)}")
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "full_attention_interval",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
            "chunk_size",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if isinstance(self.scan_unroll, bool) or not (
            isinstance(self.scan_unroll, int) and self.scan_unroll >= 1
        ):
            raise ValueError(f"scan_unroll={self.scan_unroll!r} must be a positive integer")
        if self.num_layers % self.full_attention_interval:
            raise ValueError(
                f"num_layers={self.num_layers} must be a multiple of full_attention_interval="
                f"{self.full_attention_interval}: layers run as repeated groups of DeltaNet "
                "layers closed by one attention layer"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_key_heads={self.linear_num_key_heads} must divide "
                f"linear_num_value_heads={self.linear_num_value_heads}"
            )
        if self.rotary_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(
                f"head_dim={self.head_dim} x partial_rotary_factor={self.partial_rotary_factor} "
                f"gives rotary_dim={self.rotary_dim}; it must be a positive even number <= head_dim"
            )

    @property
    def family(self) -> str:
        return "qwen3_5"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_types(self) -> tuple[str, ...]:
        i = self.full_attention_interval
        return tuple(
            "full_attention" if (n + 1) % i == 0 else "linear_attention"
            for n in range(self.num_layers)
        )

    @property
    def num_groups(self) -> int:
        """Groups of (interval - 1) DeltaNet layers and one attention layer."""
        return self.num_layers // self.full_attention_interval

    @property
    def num_linear_layers(self) -> int:
        return self.num_layers - self.num_groups

    @property
    def param_jnp_dtype(self) -> Any:
        return DTYPES[self.param_dtype]

    @property
    def compute_jnp_dtype(self) -> Any:
        return DTYPES[self.compute_dtype]

    def replace(self, **changes: Any) -> Qwen35Config:
        return dataclasses.replace(self, **changes)

    @classmethod
    def tiny(cls, **overrides: Any) -> Qwen35Config:
        """A few-thousand-parameter hybrid for tests: [DeltaNet, attention] x 2."""
        base: dict[str, Any] = dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_layers=4,
            full_attention_interval=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rope_theta=10000.0,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            chunk_size=8,
            max_position_embeddings=256,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], **overrides: Any) -> Qwen35Config:
        """Read a `qwen3_5_text` config, or the text part of a `qwen3_5` one."""
        model_type = hf.get("model_type")
        if model_type == "qwen3_5":
            hf = dict(hf.get("text_config") or {})
        elif model_type != "qwen3_5_text":
            raise ValueError(f"config.json model_type={model_type!r} is not one of {MODEL_TYPES}")
        act = hf.get("hidden_act", "silu")
        if act != "silu" or hf.get("attention_bias"):
            raise ValueError(
                f"Qwen3.5 config with hidden_act={act!r}, attention_bias="
                f"{hf.get('attention_bias')!r} is not supported (silu, no bias)"
            )
        rope = dict(hf.get("rope_parameters") or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope type {rope.get('rope_type')!r} is not supported; 'default'")
        interval = int(hf.get("full_attention_interval", 4))
        layers = int(hf["num_hidden_layers"])
        fields: dict[str, Any] = dict(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=layers,
            full_attention_interval=interval,
            num_heads=int(hf["num_attention_heads"]),
            num_kv_heads=int(hf["num_key_value_heads"]),
            head_dim=int(hf["head_dim"]),
            partial_rotary_factor=float(
                rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
            ),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            linear_num_key_heads=int(hf["linear_num_key_heads"]),
            linear_num_value_heads=int(hf["linear_num_value_heads"]),
            linear_key_head_dim=int(hf["linear_key_head_dim"]),
            linear_value_head_dim=int(hf["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(hf.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=_first(hf.get("eos_token_id")),
        )
        fields.update(overrides)
        cfg = cls(**fields)
        given = hf.get("layer_types")
        if given is not None and tuple(given) != cfg.layer_types:
            raise ValueError(
                f"layer_types {given} is not the repeating pattern of full_attention_interval="
                f"{interval}, the only layout supported"
            )
        return cfg

    def to_hf_config(self) -> dict[str, Any]:
        """A `qwen3_5_text` config dict that transformers' `Qwen3_5ForCausalLM` loads."""
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
            "layer_types": list(self.layer_types),
            "full_attention_interval": self.full_attention_interval,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "dtype": self.param_dtype,
            "use_cache": True,
        }


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) else value
