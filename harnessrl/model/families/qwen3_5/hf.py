"""Model stage: Qwen3.5 HF checkpoints ↔ `Qwen35Decoder` parameters.

In: an HF folder (`config.json`, safetensors) of a `qwen3_5_text` model or of a `qwen3_5` one
(its text model: `model.language_model.*`; the vision tower and the `mtp.*` tensors are not read),
or a dict of HF-named tensors. Out: the parameter tree (a pure dict of numpy arrays shaped like
`nnx.state(model, nnx.Param)`), and the inverse, which names tensors as `Qwen3_5ForCausalLM` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from harnessrl.model.families.qwen3_5.config import MODEL_TYPES, Qwen35Config
from harnessrl.model.formats.safetensors import bfloat16, read_safetensors

Params = dict[str, Any]
__all__ = ["MODEL_TYPES", "hf_from_params", "params_from_hf", "read_hf_folder"]
TEXT_PREFIXES = ("model.language_model.", "model.")


def layer_index(cfg: Qwen35Config, kind: str, j: int) -> int:
    """The HF layer number of the j-th DeltaNet (`linear`) or attention (`full`) layer."""
    i = cfg.full_attention_interval
    return (j // (i - 1)) * i + j % (i - 1) if kind == "linear" else j * i + i - 1


def _linear_to_ours(cfg: Qwen35Config, t: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    d, r, k = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_key_head_dim
    h, v = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    qkv = t["linear_attn.in_proj_qkv.weight"]
    conv_wc = t["linear_attn.conv1d.weight"][:, 0, :].T  # [channels, 1, W] -> [W, channels]
    kd = r * k
    return {
        "wq_ldrk": qkv[:kd].T.reshape(d, r, k),
        "wk_ldrk": qkv[kd : 2 * kd].T.reshape(d, r, k),
        "wv_ldhv": qkv[2 * kd :].T.reshape(d, h, v),
        "conv_q_lwrk": conv_wc[:, :kd].reshape(-1, r, k),
        "conv_k_lwrk": conv_wc[:, kd : 2 * kd].reshape(-1, r, k),
        "conv_v_lwhv": conv_wc[:, 2 * kd :].reshape(-1, h, v),
        "wz_ldhv": t["linear_attn.in_proj_z.weight"].T.reshape(d, h, v),
        "wb_ldh": t["linear_attn.in_proj_b.weight"].T,
        "wa_ldh": t["linear_attn.in_proj_a.weight"].T,
        "dt_bias_lh": t["linear_attn.dt_bias"],
        "a_log_lh": t["linear_attn.A_log"],
        "out_norm_lv": t["linear_attn.norm.weight"],
        "wo_lhvd": t["linear_attn.out_proj.weight"].T.reshape(h, v, d),
    }


def _linear_to_hf(cfg: Qwen35Config, w: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    d = cfg.hidden_size
    qkv = [w[n].reshape(d, -1).T for n in ("wq_ldrk", "wk_ldrk", "wv_ldhv")]
    width = cfg.linear_conv_kernel_dim
    conv = [w[n].reshape(width, -1) for n in ("conv_q_lwrk", "conv_k_lwrk", "conv_v_lwhv")]
    return {
        "linear_attn.in_proj_qkv.weight": np.concatenate(qkv, axis=0),
        "linear_attn.conv1d.weight": np.concatenate(conv, axis=1).T[:, None, :],
        "linear_attn.in_proj_z.weight": w["wz_ldhv"].reshape(d, -1).T,
        "linear_attn.in_proj_b.weight": w["wb_ldh"].T,
        "linear_attn.in_proj_a.weight": w["wa_ldh"].T,
        "linear_attn.dt_bias": w["dt_bias_lh"],
        "linear_attn.A_log": w["a_log_lh"],
        "linear_attn.norm.weight": w["out_norm_lv"],
        "linear_attn.out_proj.weight": w["wo_lhvd"].reshape(-1, d).T,
    }


def _full_to_ours(cfg: Qwen35Config, t: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    d, h, k, e = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_and_gate = t["self_attn.q_proj.weight"].T.reshape(d, h, 2 * e)  # per head: query, gate
    return {
        "wq_ldhe": q_and_gate[..., :e],
        "wg_ldhe": q_and_gate[..., e:],
        "wk_ldke": t["self_attn.k_proj.weight"].T.reshape(d, k, e),
        "wv_ldke": t["self_attn.v_proj.weight"].T.reshape(d, k, e),
        "wo_lhed": t["self_attn.o_proj.weight"].T.reshape(h, e, d),
        "q_norm_le": t["self_attn.q_norm.weight"],
        "k_norm_le": t["self_attn.k_norm.weight"],
    }


def _full_to_hf(cfg: Qwen35Config, w: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    d = cfg.hidden_size
    q_and_gate = np.concatenate([w["wq_ldhe"], w["wg_ldhe"]], axis=-1)
    return {
        "self_attn.q_proj.weight": q_and_gate.reshape(d, -1).T,
        "self_attn.k_proj.weight": w["wk_ldke"].reshape(d, -1).T,
        "self_attn.v_proj.weight": w["wv_ldke"].reshape(d, -1).T,
        "self_attn.o_proj.weight": w["wo_lhed"].reshape(-1, d).T,
        "self_attn.q_norm.weight": w["q_norm_le"],
        "self_attn.k_norm.weight": w["k_norm_le"],
    }


def _mlp_to_ours(t: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        "attn_norm_ld": t["input_layernorm.weight"],
        "mlp_norm_ld": t["post_attention_layernorm.weight"],
        "w_gate_ldf": t["mlp.gate_proj.weight"].T,
        "w_up_ldf": t["mlp.up_proj.weight"].T,
        "w_down_lfd": t["mlp.down_proj.weight"].T,
    }


def _mlp_to_hf(w: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        "input_layernorm.weight": w["attn_norm_ld"],
        "post_attention_layernorm.weight": w["mlp_norm_ld"],
        "mlp.gate_proj.weight": w["w_gate_ldf"].T,
        "mlp.up_proj.weight": w["w_up_ldf"].T,
        "mlp.down_proj.weight": w["w_down_lfd"].T,
    }


KINDS = {
    "linear": (_linear_to_ours, _linear_to_hf, "num_linear_layers"),
    "full": (_full_to_ours, _full_to_hf, "num_groups"),
}


def params_from_hf(cfg: Qwen35Config, tensors: Mapping[str, np.ndarray]) -> Params:
    """HF-named tensors (either text prefix) → our parameter tree, in `cfg.param_dtype`."""
    dtype = np.dtype(cfg.param_dtype) if cfg.param_dtype == "float32" else bfloat16()
    text: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        stripped = _strip(name)
        if stripped is not None:
            text[stripped] = value

    def get(name: str) -> np.ndarray:
        if name not in text:
            raise ValueError(
                f"checkpoint has no tensor {name!r} (nor model.language_model.*) that a Qwen3.5 "
                f"config with {cfg.num_layers} layers needs (found {len(tensors)} tensors)"
            )
        return np.asarray(text[name], np.float32)

    params: Params = {}
    for kind, (to_ours, _, count) in KINDS.items():
        per_layer = []
        for j in range(getattr(cfg, count)):
            prefix = f"model.layers.{layer_index(cfg, kind, j)}."
            names = [n[len(prefix) :] for n in text if n.startswith(prefix)]
            t = {n: get(prefix + n) for n in names}
            try:
                per_layer.append({**to_ours(cfg, t), **_mlp_to_ours(t)})
            except KeyError as err:
                raise ValueError(
                    f"checkpoint layer {prefix[:-1]} has no {err.args[0]!r}: layer_types of the "
                    f"config (every {cfg.full_attention_interval}th layer attention) do not "
                    "match the tensors"
                ) from err
        params[kind] = {
            name: np.ascontiguousarray(np.stack([w[name] for w in per_layer]).astype(dtype))
            for name in (per_layer[0] if per_layer else {})
        }
    params["embed_vd"] = get("model.embed_tokens.weight").astype(dtype)
    params["final_norm_d"] = get("model.norm.weight").astype(dtype)
    if not cfg.tie_word_embeddings:
        params["lm_head_dv"] = np.ascontiguousarray(get("lm_head.weight").T.astype(dtype))
    if params["embed_vd"].shape != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(
            f"embedding shape {params['embed_vd'].shape} does not match config "
            f"(vocab={cfg.vocab_size}, embed={cfg.hidden_size})"
        )
    return params


def hf_from_params(cfg: Qwen35Config, params: Params) -> dict[str, np.ndarray]:
    """Our parameter tree → `Qwen3_5ForCausalLM` tensor names (the inverse of `params_from_hf`)."""
    out: dict[str, np.ndarray] = {}
    for kind, (_, to_hf, count) in KINDS.items():
        stacked = {name: np.asarray(a) for name, a in params[kind].items()}
        for j in range(getattr(cfg, count)):
            w = {name: a[j] for name, a in stacked.items()}
            prefix = f"model.layers.{layer_index(cfg, kind, j)}."
            for name, value in {**to_hf(cfg, w), **_mlp_to_hf(w)}.items():
                out[prefix + name] = np.ascontiguousarray(value)
    out["model.embed_tokens.weight"] = np.asarray(params["embed_vd"])
    out["model.norm.weight"] = np.asarray(params["final_norm_d"])
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head_dv"]).T)
    return out


def read_hf_folder(path: str | Path) -> tuple[Qwen35Config, dict[str, np.ndarray]]:
    """`config.json` and the text model's tensors of every safetensors shard of a folder."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"HF model folder {str(folder)!r} has no config.json")
    cfg = Qwen35Config.from_hf_config(json.loads((folder / "config.json").read_text()))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"HF model folder {str(folder)!r} has no model.safetensors(.index.json)")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        for key, value in read_safetensors(folder / name).items():
            if _strip(key) is not None:  # the vision tower and MTP head stay on disk
                tensors[key] = value
    return cfg, tensors


def _strip(name: str) -> str | None:
    """`model.…` for a text-model tensor under either prefix, `lm_head.weight`, else None."""
    if name == "lm_head.weight":
        return name
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix) and not name.startswith("model.visual."):
            return "model." + name[len(prefix) :]
    return None
