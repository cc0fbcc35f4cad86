"""Shared, session-scoped SmolLM2 fixtures: the GGUF is dequantized once and loaded once."""

from __future__ import annotations

from typing import Any

import pytest
from torch_reference import torch_causal_lm

from harnessrl.model.families.dense.hf import params_from_hf
from harnessrl.model.formats.load import Checkpoint, LoadedModel, build_decoder, read_checkpoint


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Checkpoint:
    return read_checkpoint("smollm2")


@pytest.fixture(scope="session")
def smollm2(smollm2_checkpoint: Checkpoint) -> LoadedModel:
    cfg = smollm2_checkpoint.config
    model = build_decoder(cfg, params_from_hf(cfg, smollm2_checkpoint.tensors))
    return LoadedModel(config=cfg, model=model, tokenizer=smollm2_checkpoint.tokenizer)


@pytest.fixture(scope="session")
def make_torch_model() -> Any:
    return torch_causal_lm


@pytest.fixture(scope="session")
def torch_smollm2(smollm2_checkpoint: Checkpoint) -> Any:
    return torch_causal_lm(smollm2_checkpoint.config.to_hf_config(), smollm2_checkpoint.tensors)


@pytest.fixture(scope="session")
def torch_smollm2_float64(smollm2_checkpoint: Checkpoint) -> Any:
    """The same reference in float64: the exact logits that float32 errors are measured against."""
    cfg = smollm2_checkpoint.config
    return torch_causal_lm(cfg.to_hf_config(), smollm2_checkpoint.tensors).double()
