"""Shared, session-scoped SmolLM2 fixtures: the GGUF is dequantized once and loaded once."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from harnessrl.model.hf_import import params_from_hf
from harnessrl.model.load import Checkpoint, LoadedModel, build_decoder, read_checkpoint


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Checkpoint:
    return read_checkpoint("smollm2")


@pytest.fixture(scope="session")
def smollm2(smollm2_checkpoint: Checkpoint) -> LoadedModel:
    cfg = smollm2_checkpoint.config
    model = build_decoder(cfg, params_from_hf(cfg, smollm2_checkpoint.tensors))
    return LoadedModel(config=cfg, model=model, tokenizer=smollm2_checkpoint.tokenizer)


def torch_causal_lm(
    hf_config: dict[str, Any], tensors: dict[str, np.ndarray], attn: str = "eager"
) -> Any:
    """transformers' PyTorch reference model holding exactly `tensors` (no random init)."""
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    # One thread: OpenMP spin-waiting makes multi-threaded torch crawl when other jobs share the
    # cores (a 32-token generate went from minutes to seconds); on an idle machine it costs little.
    torch.set_num_threads(1)
    config = transformers.AutoConfig.for_model(**hf_config)
    with no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    state = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in tensors.items()}
    if hf_config["tie_word_embeddings"]:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.fixture(scope="session")
def make_torch_model() -> Any:
    return torch_causal_lm


@pytest.fixture(scope="session")
def torch_smollm2(smollm2_checkpoint: Checkpoint) -> Any:
    return torch_causal_lm(smollm2_checkpoint.config.to_hf_config(), smollm2_checkpoint.tensors)
