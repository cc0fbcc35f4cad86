"""Benchmark: learner forward+backward+AdamW tokens/s on SmolLM2, against PyTorch in the same run.

Full train steps (one packed `[rows, len]` micro-batch + apply) per numerics variant. Every timed
round runs, back to back: a matmul probe (large jitted `a @ b` in each compute dtype, the faster
one's rate), one of our steps, and one step of the PyTorch baseline in the variant's compute dtype
(transformers' model on the same weights and batch: forward, the same clipped policy-gradient
loss, backward, global-norm clipping, `torch.optim.AdamW`; float32 master weights, matmuls under
bf16 autocast for a bf16 variant). A shared host's speed drifts by tens of percent over minutes,
so each step is compared with the probe and the torch step of the same moment. All figures are
wall-clock (the time a user waits), medians over the rounds. Model FLOPs per token follow the
PaLM accounting: 6 x matmul params + 12 x layers x heads x head_dim x len; the matmul probe
fraction is those FLOP/s over the probe's, not an MFU: the probe is not the chip's peak, and the
PaLM count includes attention work a causal kernel skips, so it can pass 1. Last line:
`learner: tokens_per_s=<x> vs_torch=<r> matmul_probe_fraction=<f> dtype=<d> compiles=<n>` for
the variant with the highest fraction, where vs_torch is its tokens/s over torch's in the same
compute dtype `dtype` (> 1: we are faster); `--no-torch` leaves vs_torch out.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from harnessrl.benchmarks.model import flops_per_token, settle, torch_reference
from harnessrl.data.pack import PackedBatch
from harnessrl.host_memory import keep_freed_memory
from harnessrl.learner.config import LearnerConfig
from harnessrl.learner.losses import MAX_LOG_RATIO
from harnessrl.learner.step import Learner

VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": dict(compute_dtype="float32"),
    "bf16": dict(compute_dtype="bfloat16"),
    "fp32_remat": dict(compute_dtype="float32", remat=True),
    "fp32_scan": dict(compute_dtype="float32", scan_unroll=1),  # layers not unrolled
}
LEARNING_RATE = 1e-6
LOSS_ARRAYS = ("loss_mask", "behavior_logprobs", "advantages", "token_weights")
MIN_LENGTH = 40  # packed_batch cuts rows at positions in [16, length - 16)
TORCH_AUTOCAST = {"float32": False, "bfloat16": True}  # compute dtype -> torch bf16 autocast
TORCH_MISSING = (
    "the PyTorch baseline needs torch, a dev extra: pip install -e '.[dev]' (or "
    "pip install torch --index-url https://download.pytorch.org/whl/cpu); "
    "pass --no-torch to skip the baseline"
)


@dataclasses.dataclass(frozen=True)
class Rate:
    """A rate two ways: per wall second, and per CPU second of this process.

    The wall figure is what a user waits for and the one reported. The CPU-time figure is printed
    beside it because on a host shared with other work it counts only what this process ran.
    """

    wall: float
    cpu: float


def measure(fn: Callable[[], object], amount: float, repeats: int) -> Rate:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        fn()
    return Rate(
        amount * repeats / (time.perf_counter() - wall),
        amount * repeats / (time.process_time() - cpu),
    )


def matmul_probe(dtype: str, size: int = 2048, repeats: int = 10) -> Rate:
    """Best sustained rate of one jitted square matmul on the default device (a yardstick for
    this moment's host speed, not the chip's peak)."""
    dt = jnp.dtype(dtype)
    a = jnp.asarray(np.random.default_rng(0).normal(size=(size, size)), dt)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    runs = [measure(lambda: f(a, a).block_until_ready(), 2 * size**3, repeats) for _ in range(3)]
    return Rate(max(r.wall for r in runs), max(r.cpu for r in runs))


def best_probe(size: int = 2048) -> Rate:
    """The best matmul probe rate right now, whichever compute dtype gives it."""
    probes = [matmul_probe(dt, size, repeats=4) for dt in ("float32", "bfloat16")]
    return Rate(max(p.wall for p in probes), max(p.cpu for p in probes))


def packed_batch(rows: int, length: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Rows full of 2-4 segments each, as packing produces; every non-first token is trained."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((rows, length), np.int32)
    pos = np.zeros((rows, length), np.int32)
    for r in range(rows):
        cuts = np.sort(
            rng.choice(np.arange(16, length - 16), size=int(rng.integers(1, 4)), replace=False)
        )
        for i, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, length], strict=True)):
            seg[r, lo:hi] = i + 1
            pos[r, lo:hi] = np.arange(hi - lo)
    mask = (pos > 0).astype(np.float32)
    return {
        "tokens": rng.integers(0, vocab, (rows, length)).astype(np.int32),
        "positions": pos,
        "segment_ids": seg,
        "loss_mask": mask,
        "behavior_logprobs": np.full((rows, length), -3.0, np.float32),
        "advantages": rng.choice([-1.0, 1.0], size=(rows, 1)).astype(np.float32) * mask,
        "token_weights": mask / mask.sum(),
    }


def torch_logprobs(reference: Any, batch: dict[str, np.ndarray]) -> tuple[Any, Any]:
    """The torch model's per-token logprobs and entropies `[rows, len]`, target-aligned.

    Packed rows attend within their own segment only (a block-diagonal causal mask, as our
    attention does from `segment_ids`) and restart RoPE at each segment's `positions`.
    """
    import torch

    ids = torch.from_numpy(batch["tokens"].astype(np.int64))
    seg = torch.from_numpy(batch["segment_ids"])
    length = ids.shape[1]
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
    allowed = (seg[:, :, None] == seg[:, None, :]) & causal  # True: query may attend to key
    logits = reference(
        input_ids=ids,
        position_ids=torch.from_numpy(batch["positions"].astype(np.int64)),
        attention_mask=allowed[:, None],
    ).logits  # the model's dtype (float64 for a reference run); bfloat16 under bf16 autocast
    # Softmax and logits stay float32 in a bf16 step, as ours do (LearnerConfig.compute_dtype).
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp_all = torch.log_softmax(logits, dim=-1)
    # Position t scores token t+1; shifting the ids, not the logits, avoids a [b, t, v] copy.
    next_ids = torch.roll(ids, -1, dims=1)
    logp = logp_all.gather(-1, next_ids[..., None])[..., 0]
    with torch.no_grad():  # a metric in our step too, never differentiated at entropy_coef=0
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    pad = torch.zeros_like(logp[:, :1])
    return torch.cat([pad, logp[:, :-1]], 1), torch.cat([pad, entropy[:, :-1]], 1)


def torch_loss(reference: Any, batch: dict[str, np.ndarray], cfg: LearnerConfig) -> Any:
    """Our step's loss (`harnessrl.learner.losses`, no KL or entropy term) in torch."""
    import torch

    logp, _ = torch_logprobs(reference, batch)
    as_torch = {k: torch.from_numpy(batch[k]).to(logp.dtype) for k in batch if k in LOSS_ARRAYS}
    # Untrained positions may carry any behavior value; pinned to logp, as ours are.
    trained = as_torch["loss_mask"] > 0
    behavior = torch.where(trained, as_torch["behavior_logprobs"], logp.detach())
    ratio = torch.exp(torch.clamp(logp - behavior, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    adv = as_torch["advantages"]
    clipped = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    surrogate = torch.maximum(-adv * ratio, -adv * clipped)
    truncation = torch.clamp(cfg.tis_cap / ratio.detach(), max=1.0)
    return (as_torch["token_weights"] * surrogate * truncation).sum()


def torch_train_step(
    reference: Any, batch: dict[str, np.ndarray], cfg: LearnerConfig, dtype: str = "float32"
) -> Callable[[], None]:
    """One torch step doing our step's work: loss, backward, global-norm clip, AdamW.

    `dtype` is the compute dtype, as `LearnerConfig.compute_dtype`: bfloat16 runs the forward
    and loss under CPU bf16 autocast (matmuls in bf16, weights and AdamW float32)."""
    import torch

    if dtype not in TORCH_AUTOCAST:
        raise ValueError(f"dtype must be one of {sorted(TORCH_AUTOCAST)}, got {dtype!r}")
    autocast = TORCH_AUTOCAST[dtype]
    reference.train()
    optimizer = torch.optim.AdamW(
        reference.parameters(),
        lr=cfg.learning_rate,
        betas=(cfg.b1, cfg.b2),
        weight_decay=cfg.weight_decay,  # torch's default is 0.01, optax's (and ours) 0
    )

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = torch_loss(reference, batch, cfg)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.grad_clip_norm)
        optimizer.step()

    return step


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    dtype: str  # compute dtype, ours and torch's alike
    tokens: Rate  # median tokens per wall / CPU second
    fraction: Rate  # median of each step's model FLOP/s over the matmul probe run just before it
    compile_s: float
    compiles: int
    torch_tokens: float | None  # median torch tokens per wall second, same rounds
    vs_torch: float | None  # median over rounds of our tokens/s over torch's in that round


def median_rate(values: Sequence[Rate]) -> Rate:
    return Rate(
        float(np.median([v.wall for v in values])), float(np.median([v.cpu for v in values]))
    )


def time_variant(
    name: str,
    model: Any,
    batch: dict[str, np.ndarray],
    steps: int,
    flops_per_token: float,
    peak_size: int,
    torch_step: Callable[[], None] | None,
) -> Run:
    """One variant's timed rounds; `torch_step` must run the variant's compute dtype."""
    learner = Learner(model, LearnerConfig(learning_rate=LEARNING_RATE, **VARIANTS[name]))
    micro = [PackedBatch(**batch)]
    start = time.perf_counter()
    learner.train_step(micro)  # compile + first step
    compile_s = time.perf_counter() - start
    settle(lambda: learner.train_step(micro), torch_step)
    n = batch["tokens"].size
    rates, fractions, torch_rates = [], [], []
    for _ in range(steps):
        probe = best_probe(peak_size)
        rate = measure(lambda: learner.train_step(micro), n, 1)
        rates.append(rate)
        fractions.append(
            Rate(rate.wall * flops_per_token / probe.wall, rate.cpu * flops_per_token / probe.cpu)
        )
        if torch_step is not None:
            torch_rates.append(measure(torch_step, n, 1).wall)
    # Each round's own ratio: ours and torch a few seconds apart, on the same host speed.
    pairs = zip(rates, torch_rates, strict=True) if torch_rates else ()
    ratios = [ours.wall / theirs for ours, theirs in pairs]
    return Run(
        name,
        VARIANTS[name]["compute_dtype"],
        median_rate(rates),
        median_rate(fractions),
        compile_s,
        learner.compile_count,
        float(np.median(torch_rates)) if torch_rates else None,
        float(np.median(ratios)) if ratios else None,
    )


def torch_baseline(model: Any, batch: dict[str, np.ndarray], dtype: str) -> Callable[[], None]:
    """The warmed-up torch step in compute dtype `dtype`, on every core this process may run on
    (as XLA's pool is)."""
    import torch

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(threads or 1)
    cfg = LearnerConfig(learning_rate=LEARNING_RATE)
    step = torch_train_step(torch_reference(model), batch, cfg, dtype)
    step()  # warm-up: allocates AdamW's moments and the autograd buffers
    compute = "bf16 autocast over float32 weights" if TORCH_AUTOCAST[dtype] else "float32"
    print(
        f"torch baseline ({dtype}): torch {torch.__version__}, {torch.get_num_threads()} threads "
        "(every core this process may use); transformers model on the same weights and batch, "
        "sdpa attention with the packed segments' mask, same loss, clip_grad_norm_, "
        f"torch.optim.AdamW, {compute}, 1 warm-up step"
    )
    return step


def time_variants(
    names: Sequence[str],
    model: Any,
    batch: dict[str, np.ndarray],
    args: argparse.Namespace,
    flops_per_token: float,
) -> list[Run]:
    """Every variant against the torch baseline of its own compute dtype. Each baseline is built
    when a variant first needs it and dropped after the last one (a copy of the weights, its
    gradients and AdamW's moments each)."""
    dtypes = [VARIANTS[name]["compute_dtype"] for name in names]
    baselines: dict[str, Callable[[], None]] = {}
    runs = []
    for i, (name, dtype) in enumerate(zip(names, dtypes, strict=True)):
        if not args.no_torch and dtype not in baselines:
            baselines[dtype] = torch_baseline(model, batch, dtype)
        step = baselines.get(dtype)
        run = time_variant(name, model, batch, args.steps, flops_per_token, args.peak_size, step)
        runs.append(report(run))
        if dtype not in dtypes[i + 1 :]:
            baselines.pop(dtype, None)
    return runs


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The flags and variant names; a missing torch is reported here, before minutes of work."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2", help="smollm2 | HF folder | .gguf path")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed rounds per variant")
    parser.add_argument("--variants", default="fp32,bf16", help=f"comma list of {sorted(VARIANTS)}")
    parser.add_argument("--peak-size", type=int, default=2048, help="matmul probe side")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    args = parser.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or not names:
        parser.error(f"--variants: unknown {unknown or names}; choose from {sorted(VARIANTS)}")
    if args.rows < 1 or args.length < MIN_LENGTH or args.steps < 1 or args.peak_size < 1:
        parser.error(
            f"need --rows >= 1, --length >= {MIN_LENGTH}, --steps >= 1 and --peak-size >= 1; got "
            f"{args.rows}, {args.length}, {args.steps} and {args.peak_size}"
        )
    if not args.no_torch:
        try:
            import torch  # noqa: F401
        except ImportError:
            parser.error(TORCH_MISSING)
    return args, names


def main(argv: Sequence[str] | None = None) -> None:
    args, names = parse_args(argv)
    from harnessrl.model.families.dense.config import ModelConfig
    from harnessrl.model.formats.load import load_model

    devices = jax.devices()
    print(f"devices: {len(devices)} x {devices[0].device_kind}; XLA uses every core")
    for dt in ("float32", "bfloat16"):
        p = matmul_probe(dt, args.peak_size)
        print(
            f"matmul probe {dt} ({args.peak_size}^3): {p.wall / 1e9:.1f} GFLOP/s wall, "
            f"{p.cpu / 1e9:.1f} per CPU-second"
        )
    loaded = load_model(args.model)
    cfg = loaded.config
    if not isinstance(cfg, ModelConfig):
        raise ValueError(
            f"--model {args.model!r}: this benchmark measures the Llama/Qwen2/Qwen3 decoder"
        )
    batch = packed_batch(args.rows, args.length, cfg.vocab_size)
    fpt = flops_per_token(cfg, args.length)
    print(
        f"model: {cfg.num_layers} layers, d={cfg.hidden_size}; {fpt / 1e9:.3f} GFLOP/token; "
        f"micro-batch {args.rows}x{args.length}; {args.steps} timed rounds per variant"
    )
    runs = time_variants(names, loaded.model, batch, args, fpt)
    best = max(runs, key=lambda run: run.fraction.wall)
    print(
        f"best: {best.name} (highest wall-clock fraction of the matmul probe run beside each step)"
    )
    print(final_line(best))


def final_line(run: Run) -> str:
    vs = "" if run.vs_torch is None else f" vs_torch={run.vs_torch:.2f}"
    return (
        f"learner: tokens_per_s={run.tokens.wall:.1f}{vs} "
        f"matmul_probe_fraction={run.fraction.wall:.3f} dtype={run.dtype} compiles={run.compiles}"
    )


def report(run: Run) -> Run:
    torch_part = ""
    if run.vs_torch is not None:
        torch_part = (
            f"  torch ({run.dtype}) {run.torch_tokens:7.1f} tokens/s  vs_torch={run.vs_torch:.2f}"
        )
    print(
        f"{run.name:>11}: {run.tokens.wall:7.1f} tokens/s  matmul_probe_fraction "
        f"wall={run.fraction.wall:.3f} (per CPU-second {run.fraction.cpu:.3f}){torch_part}  "
        f"compile {run.compile_s:.0f} s  compiles={run.compiles}"
    )
    return run


if __name__ == "__main__":
    keep_freed_memory()
    main()
