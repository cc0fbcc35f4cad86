"""transformers' PyTorch models holding exactly our weights: the parity tests' reference.

A plain module (not a fixture) so the serving tests' SmolLM2 tier can build the same reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np


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
