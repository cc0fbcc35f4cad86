"""Model stage exit: decoder parameters → an HF safetensors folder that transformers and vLLM load.

In: a `LoadedModel` or a `Decoder` (plus, optionally, its `ChatTokenizer`).
Out: `config.json`, `generation_config.json`, `model.safetensors` (or shards plus
`model.safetensors.index.json`), and the tokenizer files with the chat template.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.flax import save_file

from harnessrl.model import registry
from harnessrl.model.formats.load import LoadedModel
from harnessrl.model.tokenizer import ChatTokenizer

DEFAULT_SHARD_BYTES = 4 * 1024**3


def params_numpy(model: nnx.Module) -> dict[str, Any]:
    """The decoder's parameters as a pure dict of host numpy arrays (gathered if sharded)."""
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), pure)


def export_hf(
    source: LoadedModel | nnx.Module,
    out_dir: str | Path,
    tokenizer: ChatTokenizer | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write an HF folder; the weights keep the model's param dtype (float32 or bfloat16)."""
    model: Any = source
    if isinstance(source, LoadedModel):
        model, tokenizer = source.model, tokenizer or source.tokenizer
    family = registry.find_decoder(model)
    if family is None:
        raise TypeError(
            "export_hf(source=...) needs a LoadedModel or Decoder (any model family's), got "
            f"{type(source).__name__}"
        )
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    cfg = model.cfg
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = family.hf_from_params(cfg, params_numpy(model))
    _write_safetensors(folder, tensors, max_shard_bytes)
    _write_json(folder / "config.json", cfg.to_hf_config())
    generation: dict[str, Any] = {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    }
    if tokenizer is not None:
        tokenizer.save(folder)
        generation["eos_token_id"] = list(tokenizer.eos_token_ids) or cfg.eos_token_id
    _write_json(folder / "generation_config.json", generation)
    return folder


def _write_safetensors(folder: Path, tensors: dict[str, np.ndarray], max_shard_bytes: int) -> None:
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for stale in folder.glob("model*.safetensors*"):  # a previous export with another shard count
        stale.unlink()
    for name, shard in zip(names, shards, strict=True):
        # Write then rename, so a reader never sees a half-written file.
        tmp = folder / f".{name}.tmp"
        save_file(
            {k: jnp.asarray(v) for k, v in shard.items()}, str(tmp), metadata={"format": "pt"}
        )
        os.replace(tmp, folder / name)
    if len(shards) > 1:
        weight_map = {k: name for name, shard in zip(names, shards, strict=True) for k in shard}
        total = sum(t.nbytes for t in tensors.values())
        _write_json(
            folder / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
