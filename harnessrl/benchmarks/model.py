"""Benchmark: decoder forward+backward tokens/s (SmolLM2, fixed `[rows, len]`) and its share of matmul peak.

In one run: (1) this machine's matmul peak, the best rate of a large jitted float32 `a @ b`;
(2) our decoder's jitted forward+backward of a token-mean cross-entropy on random tokens;
(3) if PyTorch is installed, transformers' model doing the same on the same weights, side by side.
FLOPs per token (PaLM accounting): 6 x N_matmul + 12 x layers x heads x head_dim x len, where
N_matmul counts q/k/v/o, gate/up/down and the LM head (the embedding lookup is not a matmul).
Last line: `model: tokens_per_s=<x> peak_fraction=<y>` (plus `vs_torch=` when torch ran).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from harnessrl.model.config import ModelConfig
from harnessrl.model.decoder import Decoder


def matmul_peak(size: int = 2048, repeats: int = 8) -> float:
    """Best sustained float32 FLOP/s of one jitted square matmul on the default device."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((size, size)), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            out = f(a, a)
        out.block_until_ready()
        best = max(best, 2 * size**3 * repeats / (time.perf_counter() - start))
    return best


def flops_per_token(cfg: ModelConfig, length: int) -> float:
    d, f, h, k, e = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
    )
    per_layer = 2 * d * h * e + 2 * d * k * e + 3 * d * f  # q, o; k, v; gate, up, down
    matmul_params = cfg.num_layers * per_layer + d * cfg.vocab_size
    return 6.0 * matmul_params + 12.0 * cfg.num_layers * h * e * length


def best_seconds(step: Callable[[], object], repeats: int) -> float:
    jax.block_until_ready(step())  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step())
        times.append(time.perf_counter() - start)
    return min(times)


def ours_step(model: Decoder, tokens: np.ndarray) -> Callable[[], object]:
    graphdef, params = nnx.split(model, nnx.Param)
    rows, length = tokens.shape
    tokens_bt = jnp.asarray(tokens)
    positions_bt = jnp.tile(jnp.arange(length, dtype=jnp.int32), (rows, 1))

    @jax.jit
    def grad_step(params: nnx.State) -> nnx.State:
        def loss(p: nnx.State) -> jax.Array:
            logits_btv = nnx.merge(graphdef, p)(tokens_bt, positions_bt)
            logp_btv = jax.nn.log_softmax(logits_btv[:, :-1], axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp_btv, tokens_bt[:, 1:, None], axis=-1))

        return jax.grad(loss)(params)

    return lambda: grad_step(params)


def torch_reference(model: Decoder, attn: str = "sdpa") -> Any:
    """transformers' PyTorch model holding exactly `model`'s weights (float32, no random init).

    Raises ImportError when torch is not installed (it is a dev extra).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from harnessrl.model.export import params_numpy
    from harnessrl.model.hf_import import hf_from_params

    hf_config = model.cfg.to_hf_config()
    with no_init_weights():  # every weight is overwritten below; random init would only cost time
        reference = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**hf_config), attn_implementation=attn, dtype=torch.float32
        )
    state = {
        k: torch.from_numpy(np.array(v, np.float32))
        for k, v in hf_from_params(model.cfg, params_numpy(model)).items()
    }
    if hf_config["tie_word_embeddings"]:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    reference.load_state_dict(state, strict=True)
    return reference


def torch_step(model: Decoder, tokens: np.ndarray) -> Callable[[], object] | None:
    try:
        import torch
    except ImportError:
        return None
    reference = torch_reference(model)
    reference.train()
    ids = torch.from_numpy(tokens.astype(np.int64))

    def step() -> None:
        reference.zero_grad(set_to_none=True)
        reference(ids, labels=ids).loss.backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2", help="smollm2 | HF folder | .gguf path")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps (best is kept)")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch side-by-side run")
    args = parser.parse_args()
    if args.rows <= 0 or args.length <= 1:
        raise ValueError(f"--rows must be > 0 and --length > 1, got {args.rows} and {args.length}")

    from harnessrl.model.load import load_model

    device = jax.devices()[0]
    print(f"device: {len(jax.devices())} x {device.device_kind}")
    peak = matmul_peak()
    print(f"matmul peak float32: {peak / 1e9:.1f} GFLOP/s (2048^3 jnp.dot, best of 3)")
    loaded = load_model(args.model)
    cfg, n = loaded.config, args.rows * args.length
    if not isinstance(cfg, ModelConfig) or not isinstance(loaded.model, Decoder):
        raise ValueError(
            f"--model {args.model!r}: this benchmark measures the Llama/Qwen2/Qwen3 decoder"
        )
    tokens = np.random.default_rng(0).integers(
        0, cfg.vocab_size, (args.rows, args.length), dtype=np.int32
    )
    fpt = flops_per_token(cfg, args.length)
    print(
        f"model: {cfg.family} {cfg.num_layers} layers d={cfg.hidden_size}; {fpt / 1e9:.3f} GFLOP/token "
        f"(6*N_matmul + 12*L*H*E*len); batch {args.rows}x{args.length}, float32"
    )
    seconds = best_seconds(ours_step(loaded.model, tokens), args.repeats)
    tokens_per_s = n / seconds
    fraction = tokens_per_s * fpt / peak
    print(
        f"ours  fwd+bwd: {seconds:6.2f} s/step  {tokens_per_s:8.1f} tokens/s  {tokens_per_s * fpt / 1e9:6.1f} GFLOP/s"
    )
    extra = ""
    step = None if args.no_torch else torch_step(loaded.model, tokens)
    if step is not None:
        torch_seconds = best_seconds(step, args.repeats)
        print(
            f"torch fwd+bwd: {torch_seconds:6.2f} s/step  {n / torch_seconds:8.1f} tokens/s (transformers, same weights)"
        )
        extra = f" vs_torch={torch_seconds / seconds:.2f}"
    print(f"model: tokens_per_s={tokens_per_s:.1f} peak_fraction={fraction:.3f}{extra}")


if __name__ == "__main__":
    main()
