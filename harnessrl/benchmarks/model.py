"""Benchmark: decoder forward+backward tokens/s (fixed `[rows, len]`) against a matmul probe.

In one run: (1) a matmul probe, the best rate of a large jitted float32 `a @ b` on this machine;
(2) our decoder's jitted forward+backward of a token-mean cross-entropy on random tokens;
(3) if PyTorch is installed, transformers' model doing the same on the same weights, side by side.
`--family llama` (default) loads `--model` (SmolLM2); `--family qwen3_5` builds a random Qwen3.5
text model of a named shape (`qwen3_5-9b-shape`: Qwen3.5-9B's widths) with `--layers` layers.
FLOPs per token (PaLM accounting): 6 x N_matmul + 12 x attention layers x heads x head_dim x len,
where N_matmul counts every projection and the LM head (the embedding lookup is not a matmul);
Qwen3.5 adds its chunked delta rule's matmuls (`qwen35_flops_per_token`).
Last line: `model: tokens_per_s=<x> matmul_probe_fraction=<y>` (plus `vs_torch=` when torch ran):
the step's model FLOP/s over the probe's. It is not an MFU: the probe is not the chip's peak, and
the PaLM count includes attention work a causal kernel skips, so it can pass 1.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from harnessrl.host_memory import keep_freed_memory
from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.families.dense.decoder import Decoder
from harnessrl.model.families.qwen3_5 import Qwen35Config, Qwen35Decoder

# Qwen3.5 on accelerators: Qwen3.5-9B's widths. On CPU SmolLM2's widths, a short row and a small
# vocab: the 9B widths need ~11 GB of host memory for our step alone (weights, gradients and a
# layer's slices, float32 at 4 layers), as much again for transformers'.
QWEN35_CPU = dict(shape="smollm2-qwen3_5", rows=1, length=128, vocab=16384)
QWEN35_ACCEL = dict(shape="qwen3_5-9b-shape", rows=1, length=4096, vocab=0)  # 0: the shape's own
SETTLE_ROUNDS = 6  # most untimed rounds before timing (`settle`)
SETTLED_FAULTS = 1000  # page faults (4 KiB pages) in one of our steps that count as settled


def matmul_probe(size: int = 2048, repeats: int = 8) -> float:
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


def qwen35_flops_per_token(cfg: Qwen35Config, length: int) -> float:
    """As `flops_per_token`, plus per DeltaNet value head the chunk's matmuls (k k^T, q k^T, the
    two inverse products, intra-chunk read: c x (3 dk + 2 dv)) and the state's (3 dk dv)."""
    d, f, h, e, k = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.head_dim,
        cfg.num_kv_heads,
    )
    r, dk, hv, dv = (
        cfg.linear_num_key_heads,
        cfg.linear_key_head_dim,
        cfg.linear_num_value_heads,
        cfg.linear_value_head_dim,
    )
    linear = (
        d * (2 * r * dk + 2 * hv * dv + 2 * hv) + hv * dv * d + 3 * d * f
    )  # qkv z b a; out; mlp
    full = d * (2 * h * e + 2 * k * e) + h * e * d + 3 * d * f  # q and gate, k v; o; mlp
    matmul_params = cfg.num_linear_layers * linear + cfg.num_groups * full + d * cfg.vocab_size
    chunk = cfg.chunk_size * (3 * dk + 2 * dv) + 3 * dk * dv
    return (
        6.0 * matmul_params
        + 12.0 * cfg.num_groups * h * e * length
        + 6.0 * cfg.num_linear_layers * hv * chunk
    )  # fmt: skip


def settle(ours: Callable[[], object], theirs: Callable[[], object] | None) -> None:
    """Untimed rounds of both steps, one after the other, until ours stops faulting in new pages.

    With both runtimes in one process and one heap (`keep_freed_memory`), each side's
    allocations land in the other's freed blocks at first, so for a few rounds XLA's per-step
    block no longer fits and the heap grows, page faults and all (measured: 3 rounds, 0.1-0.4
    million faults and 1.4-4.5 s of system time each). Training runs no second runtime; timing
    starts once the heap has settled.
    """
    for _ in range(SETTLE_ROUNDS):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        ours()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        if theirs is not None:
            theirs()
        if faults < SETTLED_FAULTS:
            return


def timed(step: Callable[[], object]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(step())
    return time.perf_counter() - start


def best_seconds(step: Callable[[], object], repeats: int) -> float:
    jax.block_until_ready(step())  # compile and warm up
    return min(timed(step) for _ in range(repeats))


def side_by_side(
    ours: Callable[[], object], theirs: Callable[[], object], repeats: int
) -> tuple[float, float, float]:
    """(our best seconds, theirs, the median of the rounds' ratios theirs/ours). Each round times
    one step of each, back to back, so a shared host's changing load weighs on both alike."""
    settle(lambda: jax.block_until_ready(ours()), theirs)  # compile, warm up, settle the heap
    rounds = [(timed(ours), timed(theirs)) for _ in range(repeats)]
    ratios = sorted(b / a for a, b in rounds)
    return min(a for a, _ in rounds), min(b for _, b in rounds), ratios[len(ratios) // 2]


def ours_step(model: Decoder | Qwen35Decoder, tokens: np.ndarray) -> Callable[[], object]:
    """Forward+backward as the learner compiles it (its layer-scan unroll and attention here)."""
    from harnessrl.learner.config import LearnerConfig
    from harnessrl.learner.losses import token_logprobs
    from harnessrl.learner.mesh import make_mesh
    from harnessrl.learner.step import scan_unroll, train_attention

    learner_cfg = LearnerConfig()
    graphdef, params = nnx.split(model, nnx.Param)
    attention = train_attention(learner_cfg, model, make_mesh(learner_cfg.mesh))
    call: dict[str, Any] = {} if attention is None else {"attention": attention}
    unroll = scan_unroll(learner_cfg, model)
    if unroll is not None and unroll != model.cfg.scan_unroll:
        cfg, build = model.cfg.replace(scan_unroll=unroll), cast(Any, type(model))
        template = nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(0)))
        graphdef = nnx.split(template, nnx.Param)[0]
    rows, length = tokens.shape
    tokens_bt = jnp.asarray(tokens)
    positions_bt = jnp.tile(jnp.arange(length, dtype=jnp.int32), (rows, 1))

    @jax.jit
    def grad_step(params: nnx.State) -> nnx.State:
        def loss(p: nnx.State) -> jax.Array:
            logits_btv = nnx.merge(graphdef, p)(tokens_bt, positions_bt, **call)
            # The learner's own log-likelihood (one exp over the vocabulary, its own VJP).
            logp_bt, _ = token_logprobs(logits_btv, tokens_bt)
            return -jnp.mean(logp_bt[:, 1:])

        return jax.grad(loss)(params)

    return lambda: grad_step(params)


def torch_reference(model: Decoder | Qwen35Decoder, attn: str = "sdpa") -> Any:
    """transformers' PyTorch model holding exactly `model`'s weights (float32, no random init).

    Raises ImportError when torch is not installed (it is a dev extra).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from harnessrl.model.families.dense.hf import hf_from_params
    from harnessrl.model.families.qwen3_5.hf import hf_from_params as qwen35_hf_from_params
    from harnessrl.model.formats.export import params_numpy

    hf_config = model.cfg.to_hf_config()
    if isinstance(model, Qwen35Decoder):
        tensors = qwen35_hf_from_params(model.cfg, params_numpy(model))
    else:
        tensors = hf_from_params(model.cfg, params_numpy(model))
    with no_init_weights():  # every weight is overwritten below; random init would only cost time
        reference = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**hf_config), attn_implementation=attn, dtype=torch.float32
        )
    state = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in tensors.items()}
    if hf_config["tie_word_embeddings"]:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    reference.load_state_dict(state, strict=True)
    return reference


def torch_step(model: Decoder | Qwen35Decoder, tokens: np.ndarray) -> Callable[[], object] | None:
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


def qwen35_model(args: argparse.Namespace) -> Qwen35Decoder:
    """A random Qwen3.5 text model of `--shape` with `--layers` layers (and `--vocab` if set)."""
    from harnessrl.model.families.qwen3_5 import SHAPES as QWEN35_SHAPES

    if args.shape not in QWEN35_SHAPES:
        raise ValueError(f"--shape {args.shape!r} is not one of {sorted(QWEN35_SHAPES)}")
    shape = {**QWEN35_SHAPES[args.shape], "num_layers": args.layers}
    cfg = Qwen35Config(**shape, **({"vocab_size": args.vocab} if args.vocab else {}))
    return Qwen35Decoder(cfg, rngs=nnx.Rngs(0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", default="llama", choices=("llama", "qwen3_5"))
    parser.add_argument("--model", default="smollm2", help="llama: smollm2 | HF folder | .gguf")
    parser.add_argument(
        "--shape", help="qwen3_5: a named shape (qwen3_5-9b-shape; CPU: smollm2-qwen3_5)"
    )
    parser.add_argument("--layers", type=int, default=4, help="qwen3_5: layers (interval 4: 3+1)")
    parser.add_argument("--vocab", type=int, help="qwen3_5: vocab (default: 16384 on CPU, real)")
    parser.add_argument("--rows", type=int, help="default 8 (qwen3_5: 1)")
    parser.add_argument("--length", type=int, help="default 256 (qwen3_5: 128 on CPU, else 4096)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (ours, then torch)")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch side-by-side run")
    parser.add_argument("--peak-size", type=int, default=2048, help="matmul probe side")
    args = parser.parse_args()
    device = jax.devices()[0]
    qwen = QWEN35_CPU if device.platform == "cpu" else QWEN35_ACCEL
    defaults = qwen if args.family == "qwen3_5" else dict(shape="", rows=8, length=256, vocab=0)
    for key, value in defaults.items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    if args.rows <= 0 or args.length <= 1 or args.peak_size <= 0:
        raise ValueError(
            f"--rows and --peak-size must be > 0 and --length > 1, got {args.rows}, "
            f"{args.peak_size} and {args.length}"
        )

    from harnessrl.model.formats.load import load_model

    print(f"device: {len(jax.devices())} x {device.device_kind}")
    probe = matmul_probe(args.peak_size)
    print(
        f"matmul probe float32: {probe / 1e9:.1f} GFLOP/s ({args.peak_size}^3 jnp.dot, best of 3)"
    )
    model: Decoder | Qwen35Decoder
    if args.family == "qwen3_5":
        model = qwen35_model(args)
        fpt = qwen35_flops_per_token(model.cfg, args.length)
    else:
        loaded = load_model(args.model)
        if not isinstance(loaded.config, ModelConfig) or not isinstance(loaded.model, Decoder):
            raise ValueError(
                f"--model {args.model!r} is a {loaded.config.family} model: pass --family"
            )
        model, fpt = loaded.model, flops_per_token(loaded.config, args.length)
    cfg, n = model.cfg, args.rows * args.length
    tokens = np.random.default_rng(0).integers(
        0, cfg.vocab_size, (args.rows, args.length), dtype=np.int32
    )
    print(
        f"model: {cfg.family} {cfg.num_layers} layers d={cfg.hidden_size} vocab={cfg.vocab_size}; "
        f"{fpt / 1e9:.3f} GFLOP/token; batch {args.rows}x{args.length}, float32"
    )
    ours = ours_step(model, tokens)
    step = None if args.no_torch else torch_step(model, tokens)
    del model  # the torch copy holds the weights now; host memory is the limit at real widths
    extra = ""
    if step is None:
        seconds = best_seconds(ours, args.repeats)
    else:
        seconds, torch_seconds, ratio = side_by_side(ours, step, args.repeats)
        extra = f" vs_torch={ratio:.2f}"
    tokens_per_s = n / seconds
    fraction = tokens_per_s * fpt / probe
    print(
        f"ours  fwd+bwd: {seconds:6.2f} s/step  {tokens_per_s:8.1f} tokens/s  {tokens_per_s * fpt / 1e9:6.1f} GFLOP/s"
    )
    if step is not None:
        print(
            f"torch fwd+bwd: {torch_seconds:6.2f} s/step  {n / torch_seconds:8.1f} tokens/s (transformers, same weights; vs_torch: median of the rounds' ratios)"
        )
    print(f"model: tokens_per_s={tokens_per_s:.1f} matmul_probe_fraction={fraction:.3f}{extra}")


if __name__ == "__main__":
    keep_freed_memory()
    main()
