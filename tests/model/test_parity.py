"""Parity with transformers' PyTorch models on identical weights (live, torch CPU).

Every comparison also runs the reference in float64 and bounds our float32 error by a multiple of
the reference's own float32 error on the same input (`reference_bounds`), so the bounds follow
the model's numerics and the machine's summation order instead of one host's measurement.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from reference_bounds import assert_logits_match_reference

from harnessrl.model.cache import KVCache
from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.families.dense.decoder import Decoder
from harnessrl.model.families.dense.hf import hf_from_params
from harnessrl.model.formats.export import params_numpy
from harnessrl.model.formats.load import LoadedModel

TINY = {
    "llama": {"rope_scaling": None},
    "llama3_rope": {"rope_scaling": "llama3", "max_position_embeddings": 64},
    "qwen2": {"family": "qwen2", "qkv_bias": True, "tie_word_embeddings": True},
    "qwen3": {"family": "qwen3", "qk_norm": True, "num_kv_heads": 1},
}
PROMPT = [{"role": "user", "content": "What is 7 + 5? Answer with just the number."}]


def _forward(model: Decoder, ids: list[int]) -> np.ndarray:
    tokens = jnp.asarray([ids], jnp.int32)
    fn = nnx.jit(lambda m, t, p: m(t, p))
    return np.asarray(fn(model, tokens, jnp.arange(len(ids), dtype=jnp.int32)[None]))


def _random_tiny(name: str) -> Decoder:
    from harnessrl.model.families.dense.config import RopeScaling

    kw: dict[str, Any] = dict(TINY[name])
    if kw.get("rope_scaling") == "llama3":
        kw["rope_scaling"] = RopeScaling(factor=4.0, original_max_position_embeddings=16)
    model = Decoder(ModelConfig.tiny(**kw), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(7)
    noisy = jax.tree.map(
        lambda x: x + 0.2 * rng.standard_normal(x.shape).astype(x.dtype),
        nnx.state(model, nnx.Param),
    )
    nnx.update(model, noisy)
    return model


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_random_models_match_transformers(name: str, make_torch_model: Any) -> None:
    model = _random_tiny(name)
    cfg = model.cfg
    tensors = hf_from_params(cfg, params_numpy(model))
    reference = make_torch_model(cfg.to_hf_config(), tensors)
    # The reference reads our exported config: it is a Qwen3/Qwen2/Llama model as transformers knows it.
    assert type(reference).__name__.lower().startswith(cfg.family)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 40).tolist()
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits.numpy()
        exact = reference.double()(torch.tensor([ids])).logits.numpy()
    assert_logits_match_reference(_forward(model, ids), want, exact, name)


def test_smollm2_logits_match_transformers(
    smollm2: LoadedModel, torch_smollm2: Any, torch_smollm2_float64: Any
) -> None:
    assert smollm2.tokenizer is not None
    ids = smollm2.tokenizer.apply_chat_template(PROMPT)
    with torch.no_grad():
        want = torch_smollm2(torch.tensor([ids])).logits.numpy()
        exact = torch_smollm2_float64(torch.tensor([ids])).logits.numpy()
    assert_logits_match_reference(_forward(smollm2.model, ids), want, exact)


PROMPTS = [
    "Write a haiku about the sea.",
    "Hello!",
    "Explain gradient descent in two sentences to a ten year old who likes football.",
    "Translate 'bonjour le monde' to English.",
]


def test_smollm2_float32_error_matches_torch_against_float64(
    smollm2: LoadedModel, torch_smollm2: Any, torch_smollm2_float64: Any
) -> None:
    """Against transformers in float64, our float32 logits err about as much as torch's own.

    SmolLM2's residual stream reaches ~2.5e4, so float32 rounding of that size reaches the logits
    (~1e-4 for both implementations), and how much depends on the CPU and on how each backend
    orders its sums: the bound is a multiple of torch's float32 error on the same prompt (see
    `reference_bounds`), not a constant.
    """
    assert smollm2.tokenizer is not None
    for prompt in PROMPTS:
        ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        with torch.no_grad():
            exact = torch_smollm2_float64(torch.tensor([ids])).logits.numpy()
            torch32 = torch_smollm2(torch.tensor([ids])).logits.numpy()
        assert_logits_match_reference(_forward(smollm2.model, ids), torch32, exact, prompt)


def greedy_through_cache(
    model: Decoder, prompt: list[int], steps: int, slots: int = 2
) -> list[int]:
    """Prefill slot 1 (slot 0 idles with position -1), then decode one token per call."""
    cache = KVCache.create(model.cfg, slots=slots, max_len=len(prompt) + steps)
    decode = nnx.jit(lambda m, t, p, c: m.decode(t, p, c))
    n = len(prompt)
    tokens = np.zeros((slots, n), np.int32)
    positions = np.full((slots, n), -1, np.int32)
    tokens[1], positions[1] = prompt, np.arange(n)
    logits, cache = decode(model, jnp.asarray(tokens), jnp.asarray(positions), cache)
    out = [int(np.argmax(logits[1, -1]))]
    for step in range(steps - 1):
        tokens = np.asarray([[0], [out[-1]]], np.int32)
        positions = np.asarray([[-1], [n + step]], np.int32)
        logits, cache = decode(model, jnp.asarray(tokens), jnp.asarray(positions), cache)
        out.append(int(np.argmax(logits[1, 0])))
    return out


def test_smollm2_greedy_32_tokens_match_transformers_generate(
    smollm2: LoadedModel, torch_smollm2: Any
) -> None:
    assert smollm2.tokenizer is not None
    prompt = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about the sea."}]
    )
    with torch.no_grad():
        ref = torch_smollm2.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            pad_token_id=0,
        )
    want = ref[0, len(prompt) :].tolist()
    got = greedy_through_cache(smollm2.model, prompt, 32)
    assert got == want, (smollm2.tokenizer.decode(got), smollm2.tokenizer.decode(want))
