"""Model stage: Hugging Face checkpoints ↔ decoder parameters.

In: an HF folder (`config.json` + `model.safetensors` or a sharded `model.safetensors.index.json`),
or a dict of HF-named tensors. Out: `ModelConfig` and the decoder's parameter tree (a pure dict of
numpy arrays shaped like `nnx.state(model, nnx.Param)`), and the inverse mapping used by export.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.formats.safetensors import bfloat16, read_safetensors

Params = dict[str, Any]  # {"embed_vd": arr, "layers": {"wq_ldhe": arr, ...}, ...}


def _layer_table(cfg: ModelConfig) -> list[tuple[str, str, Callable, Callable]]:
    """(our stacked name, HF per-layer name, HF→ours, ours→HF) for one layer's tensors."""
    d, h, k, e = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def same(w: np.ndarray) -> np.ndarray:
        return w

    def transpose(w: np.ndarray) -> np.ndarray:
        return w.T

    def projection(*out: int) -> tuple[Callable, Callable]:
        """HF Linear [out, in] <-> ours [in, *out], so projections read left to right."""
        return lambda w: w.T.reshape(d, *out), lambda w: w.reshape(d, -1).T

    def bias(*out: int) -> tuple[Callable, Callable]:
        return lambda b: b.reshape(*out), lambda b: b.reshape(-1)

    table = [
        ("attn_norm_ld", "input_layernorm.weight", same, same),
        ("wq_ldhe", "self_attn.q_proj.weight", *projection(h, e)),
        ("wk_ldke", "self_attn.k_proj.weight", *projection(k, e)),
        ("wv_ldke", "self_attn.v_proj.weight", *projection(k, e)),
        (
            "wo_lhed",
            "self_attn.o_proj.weight",
            lambda w: w.T.reshape(h, e, d),
            lambda w: w.reshape(h * e, d).T,
        ),
        ("mlp_norm_ld", "post_attention_layernorm.weight", same, same),
        ("w_gate_ldf", "mlp.gate_proj.weight", transpose, transpose),
        ("w_up_ldf", "mlp.up_proj.weight", transpose, transpose),
        ("w_down_lfd", "mlp.down_proj.weight", transpose, transpose),
    ]
    if cfg.qkv_bias:
        table += [
            ("bq_lhe", "self_attn.q_proj.bias", *bias(h, e)),
            ("bk_lke", "self_attn.k_proj.bias", *bias(k, e)),
            ("bv_lke", "self_attn.v_proj.bias", *bias(k, e)),
        ]
    if cfg.qk_norm:
        table += [
            ("q_norm_le", "self_attn.q_norm.weight", same, same),
            ("k_norm_le", "self_attn.k_norm.weight", same, same),
        ]
    return table


def params_from_hf(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> Params:
    """HF-named tensors → our parameter tree (layers stacked), in `cfg.param_dtype`."""
    dtype = bfloat16() if cfg.param_dtype == "bfloat16" else np.dtype(cfg.param_dtype)

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(
                f"checkpoint has no tensor {name!r} that a {cfg.family} config with "
                f"{cfg.num_layers} layers needs (found {len(tensors)} tensors)"
            )
        return np.asarray(tensors[name])

    def cast(w: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(w.astype(dtype))

    layers = {}
    for ours, hf_name, to_ours, _ in _layer_table(cfg):
        per_layer = [to_ours(get(f"model.layers.{i}.{hf_name}")) for i in range(cfg.num_layers)]
        layers[ours] = cast(np.stack(per_layer))
    params: Params = {
        "embed_vd": cast(get("model.embed_tokens.weight")),
        "layers": layers,
        "final_norm_d": cast(get("model.norm.weight")),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head_dv"] = cast(get("lm_head.weight").T)
    _check_shapes(cfg, params)
    return params


def hf_from_params(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """Our parameter tree → HF-named tensors (the inverse of `params_from_hf`)."""
    layers = params["layers"]
    assert isinstance(layers, Mapping)
    out: dict[str, np.ndarray] = {}
    for ours, hf_name, _, to_hf in _layer_table(cfg):
        stacked = np.asarray(layers[ours])
        for i in range(cfg.num_layers):
            out[f"model.layers.{i}.{hf_name}"] = np.ascontiguousarray(to_hf(stacked[i]))
    out["model.embed_tokens.weight"] = np.asarray(params["embed_vd"])
    out["model.norm.weight"] = np.asarray(params["final_norm_d"])
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head_dv"]).T)
    return out


def read_hf_folder(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read `config.json` and every safetensors shard of an HF model folder."""
    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"HF model folder {str(folder)!r} has no config.json")
    cfg = ModelConfig.from_hf_config(json.loads(config_path.read_text()))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(
            f"HF model folder {str(folder)!r} has neither model.safetensors nor "
            "model.safetensors.index.json (PyTorch .bin checkpoints are not supported)"
        )
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        tensors.update(read_safetensors(folder / name))
    return cfg, tensors


def _check_shapes(cfg: ModelConfig, params: Params) -> None:
    n, d, v = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    if np.shape(params["embed_vd"]) != (v, d):
        raise ValueError(
            f"embedding shape {np.shape(params['embed_vd'])} does not match config (vocab={v}, embed={d})"
        )
    layers = params["layers"]
    assert isinstance(layers, Mapping)
    if np.shape(layers["w_gate_ldf"]) != (n, d, cfg.intermediate_size):
        raise ValueError(
            f"mlp weight shape {np.shape(layers['w_gate_ldf'])} does not match config "
            f"(layers={n}, embed={d}, mlp={cfg.intermediate_size})"
        )
