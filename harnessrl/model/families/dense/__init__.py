"""Model stage, dense family: Llama / SmolLM2, Qwen2 and Qwen3 dense decoders.

Pre-norm layers of GQA softmax attention with RoPE and a SwiGLU MLP (`decoder.py`); Qwen2 adds
q/k/v biases, Qwen3 q/k RMSNorms (`config.py`). HF safetensors (`hf.py`) and GGUF (`gguf.py`) in,
HF safetensors out. `FAMILY` is its row of `harnessrl.model.registry`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from gguf import GGUFReader

from harnessrl.model.cache import KVCache
from harnessrl.model.families.dense import gguf, hf, memory
from harnessrl.model.families.dense.config import ARCHITECTURES, HF_SHAPES, ModelConfig
from harnessrl.model.families.dense.decoder import Decoder

# What `load_policy` builds for `tiny` (random weights around SmolLM2's 49,152-token tokenizer).
TINY_VOCAB = 49152


def _tiny(vocab_size: int) -> ModelConfig:
    return ModelConfig.tiny(
        vocab_size=vocab_size, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2
    )


class Dense:
    name = "dense"
    label = "Llama / Qwen2 / Qwen3 dense"
    model_types = tuple(ARCHITECTURES)
    gguf_architectures = gguf.SUPPORTED
    config = ModelConfig
    decoder = Decoder
    cache = KVCache
    recurrent = False
    serves_bf16_weights = True
    decode_kernels = True
    segment_attention = True
    unroll_layers_on_cpu = True
    shapes: Mapping[str, Mapping[str, Any]] = HF_SHAPES
    random_specs = ("tiny",)
    planned_shapes: ClassVar[Mapping[str, Callable[[], Any]]] = {
        **{
            name: functools.partial(ModelConfig.from_hf_config, hf)
            for name, hf in HF_SHAPES.items()
        },
        "smollm2": ModelConfig,  # the defaults are SmolLM2-135M-Instruct
        "tiny": lambda: ModelConfig.tiny(vocab_size=TINY_VOCAB, max_position_embeddings=4096),
    }

    def random_config(self, spec: str, vocab_size: int) -> ModelConfig:
        assert spec in self.random_specs, spec
        return _tiny(vocab_size)

    def params_from_hf(self, cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> hf.Params:
        return hf.params_from_hf(cfg, tensors)

    def hf_from_params(self, cfg: ModelConfig, params: hf.Params) -> dict[str, np.ndarray]:
        return hf.hf_from_params(cfg, params)

    def read_hf_folder(self, path: Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
        return hf.read_hf_folder(path)

    def read_gguf(
        self, reader: GGUFReader, meta: dict[str, Any]
    ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
        return gguf.read_gguf(reader, meta)

    def layer_kinds(
        self, cfg: ModelConfig, per_chip: memory.PerChip, b: int, t: int, c: int
    ) -> list[tuple[int, int, int, int]]:
        return memory.layer_kinds(cfg, per_chip, b, t, c)


FAMILY = Dense()
