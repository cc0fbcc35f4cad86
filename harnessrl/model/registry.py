"""Model stage: the one table from a model spec, an HF `model_type` or a GGUF architecture to the
family that builds, reads and writes that decoder.

In: a spec name (`tiny`, `qwen3-8b`, ...), an HF `config.json` dict or folder, a config or a
decoder. Out: its `Family` (`harnessrl.model.families.*`), which everything outside the families
asks instead of naming one. Adding a family is one folder and one row of
`harnessrl.model.families.FAMILIES` (docs/model.md, "Adding a model family").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from gguf import GGUFReader

from harnessrl.model.families import FAMILIES as FAMILY_ROWS
from harnessrl.model.formats.gguf import read_metadata
from harnessrl.model.memory import PerChip

Params = dict[str, Any]  # a decoder's parameter tree as nested dicts of arrays
Tensors = dict[str, np.ndarray]  # HF-named checkpoint tensors
# A family's decoder: an nnx.Module with `cfg`, `__call__` and `decode` (signatures per family).
AnyDecoder = Any


class Family(Protocol):
    """What the rest of harnessrl knows of a decoder family."""

    @property
    def name(self) -> str: ...
    @property
    def label(self) -> str: ...  # the name people know it by, in messages
    @property
    def model_types(self) -> tuple[str, ...]: ...  # HF config.json `model_type`s it reads
    @property
    def gguf_architectures(self) -> tuple[str, ...]: ...  # GGUF `general.architecture`s
    @property
    def config(self) -> Any: ...  # the config class: from_hf_config, to_hf_config, replace
    @property
    def decoder(self) -> Any: ...  # the nnx.Module class, built as decoder(cfg, rngs=...)
    @property
    def cache(self) -> Any: ...  # the serving cache class: cache.create(cfg, slots=, max_len=)
    # A recurrent state holds its slot's latest token and cannot rewind or restart mid-row: no
    # prompt copies, no prefix resumes, no packed prefill.
    @property
    def recurrent(self) -> bool: ...
    @property
    def serves_bf16_weights(self) -> bool: ...  # engine weight_dtype='bfloat16' (held as bits)
    @property
    def decode_kernels(self) -> bool: ...  # decode(..., kernels=) takes engine.cpu_kernels
    @property
    def segment_attention(self) -> bool: ...  # __call__(..., attention=) takes a training kernel
    @property
    def unroll_layers_on_cpu(self) -> bool: ...  # the learner's automatic layer-scan unroll
    @property
    def shapes(self) -> Mapping[str, Mapping[str, Any]]: ...  # named config keyword sets
    @property
    def random_specs(self) -> tuple[str, ...]: ...  # spec names served with random weights
    @property
    def planned_shapes(self) -> Mapping[str, Callable[[], Any]]: ...  # planner's named shapes

    def random_config(self, spec: str, vocab_size: int) -> Any: ...
    def params_from_hf(self, cfg: Any, tensors: Mapping[str, np.ndarray]) -> Params: ...
    def hf_from_params(self, cfg: Any, params: Params) -> Tensors: ...
    def read_hf_folder(self, path: Path) -> tuple[Any, Tensors]: ...
    def read_gguf(self, reader: GGUFReader, meta: dict[str, Any]) -> tuple[Any, Tensors]: ...
    def layer_kinds(
        self, cfg: Any, per_chip: PerChip, b: int, t: int, c: int
    ) -> list[tuple[int, int, int, int]]: ...


FAMILIES: tuple[Family, ...] = FAMILY_ROWS
RANDOM_SPECS: tuple[str, ...] = tuple(s for f in FAMILIES for s in f.random_specs)
PLANNED_SHAPES: dict[str, Callable[[], Any]] = {
    name: build for f in FAMILIES for name, build in f.planned_shapes.items()
}


def by_name(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"model family {name!r} is not one of {[f.name for f in FAMILIES]}")


def of(thing: Any) -> Family:
    """The family of a config or a decoder (a subclass of a family's decoder included)."""
    for family in FAMILIES:
        if isinstance(thing, (family.config, family.decoder)):
            return family
    raise TypeError(f"{type(thing).__name__} is neither a config nor a decoder of a model family")


def find_decoder(model: Any) -> Family | None:
    """The family of a decoder, or None for a module that is not one of ours (e.g. a test's)."""
    return next((f for f in FAMILIES if isinstance(model, f.decoder)), None)


def for_random_spec(spec: str) -> Family | None:
    return next((f for f in FAMILIES if spec in f.random_specs), None)


def for_hf_config(hf: Mapping[str, Any]) -> Family:
    """The family whose HF `model_type`s include this config's; the dense family reports the
    unsupported ones, naming what it reads."""
    model_type = hf.get("model_type")
    return next((f for f in FAMILIES if model_type in f.model_types), FAMILIES[0])


def config_from_hf(hf: dict[str, Any]) -> Any:
    return for_hf_config(hf).config.from_hf_config(hf)


def read_hf_folder(path: Path) -> tuple[Any, Tensors]:
    config = path / "config.json"
    hf = json.loads(config.read_text()) if config.is_file() else {}
    return for_hf_config(hf).read_hf_folder(path)


def read_gguf(path: Path) -> tuple[Any, Tensors, dict[str, Any]]:
    """Config, tensors with HF names and layouts (dequantized to float32), and metadata."""
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    reader = GGUFReader(str(path))
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    readers = {a: f for f in FAMILIES for a in f.gguf_architectures}
    if arch not in readers:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {tuple(readers)}"
        )
    cfg, tensors = readers[arch].read_gguf(reader, meta)
    return cfg, tensors, meta
