"""ModelConfig: HF config round trips, family flags, and clear errors for what is unsupported."""

from __future__ import annotations

import pytest

from harnessrl.model.families.dense.config import ModelConfig, RopeScaling


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(),
        ModelConfig.tiny(family="qwen2", qkv_bias=True, tie_word_embeddings=True),
        ModelConfig.tiny(family="qwen3", qk_norm=True, head_dim=16),
        ModelConfig.tiny(rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=64)),
    ],
)
def test_hf_config_round_trip(cfg: ModelConfig) -> None:
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


def test_reads_transformers_4_style_qwen2_config() -> None:
    hf = {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "eos_token_id": [151645, 151643],
    }
    cfg = ModelConfig.from_hf_config(hf, param_dtype="bfloat16")
    assert (cfg.head_dim, cfg.qkv_bias, cfg.qk_norm, cfg.eos_token_id) == (64, True, False, 151645)
    assert cfg.rope_theta == 1e6 and cfg.param_dtype == "bfloat16"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "model_type='gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "sliding"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_unsupported_hf_configs_raise(change: dict, message: str) -> None:
    hf = {**ModelConfig.tiny().to_hf_config(), **change}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(hf)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"family": "mistral"}, "family"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"head_dim": 7}, "head_dim"),
        ({"param_dtype": "float16"}, "param_dtype"),
        ({"hidden_size": 0}, "hidden_size"),
    ],
)
def test_bad_fields_raise(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.tiny(**kw)
