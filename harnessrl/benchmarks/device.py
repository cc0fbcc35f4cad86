"""Benchmark: one accelerator's train-step MFU, embedded-engine decode tokens/s and compile counts.

On a GPU or TPU: Qwen3-8B-shaped layers (d 4096, 32 heads, 8 KV heads, head_dim 128, MLP 12288,
vocab 151936; `--layers` of them so the model and AdamW state fit one chip), bf16 compute over
float32 master weights, `--rows` x `--length` tokens per step. On CPU a tiny model of the same
family, so CI runs the same code. MFU = model FLOPs/s (PaLM accounting, `benchmarks.model`) over
the chip's dense bf16 peak (`PEAK_BF16`; an unknown chip reports FLOP/s and `mfu=na`). Decode is
the engine at concurrency 8 on the same shapes (bf16 weights), prefill included. Prefill is a
Qwen3.5 prompt chunk through one DeltaNet layer of Qwen3.5-9B's widths, the chunked delta rule
against the token-by-token recurrence (`benchmarks.prefill`; CPU: the tiny shape). `--budget-s`
bounds the run: timed train steps stop early and decode is skipped when too little is left.
Last line: `device: platform=<p> kind=<k> mfu=<m> train_tokens_s=<t> decode_tokens_s=<d>
compiles_train=<n> compiles_decode=<n> prefill_speedup=<s>` (one line).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from harnessrl.benchmarks.learner import packed_batch
from harnessrl.benchmarks.model import flops_per_token
from harnessrl.benchmarks.prefill import compare
from harnessrl.data.pack import PackedBatch
from harnessrl.engine.decode import Engine, TokenEvent
from harnessrl.engine.sampler import SamplingParams
from harnessrl.host_memory import keep_freed_memory
from harnessrl.learner.config import LearnerConfig
from harnessrl.learner.step import Learner
from harnessrl.model.families.dense.config import HF_SHAPES, ModelConfig
from harnessrl.model.families.dense.decoder import Decoder
from harnessrl.model.families.qwen3_5 import SHAPES as QWEN35_SHAPES
from harnessrl.model.families.qwen3_5 import Qwen35Config
from harnessrl.serve.config import ServeConfig

TINY_QWEN3 = dict(
    family="qwen3", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=256, qk_norm=True, tie_word_embeddings=False,
    max_position_embeddings=1024,
)  # fmt: skip
# Per platform: model shape and run sizes (--layers/--rows/--length override the first three).
SIZES: dict[str, dict[str, Any]] = {
    "accel": dict(layers=4, rows=1, length=8192, shape=None, steps=5, prompt=128, decode=256,
                  qwen35="qwen3_5-9b-shape", prefill=2048),
    # The suite runs this one: as small as still exercises every program (compiles dominate).
    "cpu": dict(layers=1, rows=1, length=64, shape=TINY_QWEN3, steps=1, prompt=8, decode=8,
                qwen35="tiny-qwen3_5", prefill=64),
}  # fmt: skip
# Dense bf16 peak FLOP/s by a substring of jax's device_kind, first match wins.
PEAK_BF16 = (
    ("H200", 989e12), ("H100", 989e12), ("A100", 312e12),
    ("v5 lite", 197e12), ("v5e", 197e12), ("v5p", 459e12), ("v6", 918e12),
)  # fmt: skip
CONCURRENCY = 8


def peak_flops(kind: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16 if key.lower() in kind.lower()), None)


def train_section(
    cfg: ModelConfig, rows: int, length: int, steps: int, deadline: float
) -> tuple[float, int, int]:
    """(tokens/s over the timed steps, compiles after warm-up, compiles at the end)."""
    learner = Learner(Decoder(cfg, rngs=nnx.Rngs(0)), LearnerConfig(compute_dtype="bfloat16"))
    batch = PackedBatch(**packed_batch(rows, length, cfg.vocab_size))
    learner.train_step([batch])  # compiles the micro-step and apply; returns host metrics
    warm = learner.compile_count
    done, start = 0, time.perf_counter()
    while done < steps and (done == 0 or time.perf_counter() < deadline):
        learner.train_step([batch])
        done += 1
    tokens_s = rows * length * done / (time.perf_counter() - start)
    compiles = learner.compile_count
    learner.close()
    return tokens_s, warm, compiles


def decode_round(engine: Engine, prompt: int, tokens: int, vocab: int) -> float:
    """Decode tokens/s of CONCURRENCY requests of `tokens` sampled tokens each, submitted at once."""
    rng = np.random.default_rng(0)
    left, done = [CONCURRENCY], threading.Event()

    def sink(events: list[TokenEvent]) -> None:
        if any(e.finish_reason for e in events):
            left[0] -= 1
            if left[0] == 0:
                done.set()

    start = time.perf_counter()
    for i in range(CONCURRENCY):
        ids = rng.integers(0, vocab, prompt).tolist()
        engine.submit(ids, SamplingParams(ignore_eos=True, seed=i), tokens, sink)
    if not done.wait(600):
        raise RuntimeError(f"decode: {left[0]} of {CONCURRENCY} requests did not finish in 600 s")
    return CONCURRENCY * tokens / (time.perf_counter() - start)


def decode_section(cfg: ModelConfig, prompt: int, tokens: int) -> tuple[float, int, int]:
    """(decode tokens/s at concurrency 8, compiles after warm-up, compiles at the end)."""
    served = cfg.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    bucket = 1 << (prompt - 1).bit_length()
    config = ServeConfig(
        num_slots=CONCURRENCY, max_model_len=bucket + tokens, prefill_buckets=(bucket,)
    )
    engine = Engine(Decoder(served, rngs=nnx.Rngs(0)), [cfg.vocab_size - 1], config)
    engine.warm_up()
    warm = engine.compile_count
    engine.start()
    try:
        decode_round(engine, prompt, min(tokens, 8), cfg.vocab_size)  # first-use costs
        tokens_s = decode_round(engine, prompt, tokens, cfg.vocab_size)
    finally:
        engine.stop()
    return tokens_s, warm, engine.compile_count


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, help="decoder layers (default: 4, CPU 1)")
    parser.add_argument("--rows", type=int, help="rows per train step (default: 1, CPU 1)")
    parser.add_argument("--length", type=int, help="tokens per row (default: 8192, CPU 64)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall-clock bound (s)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    device = jax.devices()[0]
    size = SIZES["cpu" if device.platform == "cpu" else "accel"]
    layers, rows, length = (
        size[k] if getattr(args, k) is None else getattr(args, k)
        for k in ("layers", "rows", "length")
    )
    if min(layers, rows) < 1 or length < 40 or args.budget_s <= 0:
        raise ValueError(
            f"need --layers, --rows >= 1, --length >= 40 and --budget-s > 0; got {layers}, "
            f"{rows}, {length}, {args.budget_s}"
        )
    cfg = (  # accelerators: Qwen3-8B's own widths, as the memory planner names them
        ModelConfig.from_hf_config(HF_SHAPES["qwen3-8b"], num_layers=layers)
        if size["shape"] is None
        else ModelConfig(**size["shape"], num_layers=layers)
    )
    print(f"device: {len(jax.devices())} x {device.device_kind} ({device.platform})")
    print(f"model: qwen3 {layers} layers d={cfg.hidden_size}; train {rows}x{length}, bf16 compute")
    # Train gets up to 60% of the budget; decode runs only if a third of it is left.
    deadline = started + 0.6 * args.budget_s
    train_s, train_warm, train_end = train_section(cfg, rows, length, size["steps"], deadline)
    fpt, peak = flops_per_token(cfg, length), peak_flops(device.device_kind)
    mfu = "na" if peak is None else f"{train_s * fpt / peak:.3f}"
    print(
        f"train: {train_s:.1f} tokens/s, {train_s * fpt / 1e12:.2f} TFLOP/s, peak "
        f"{'unknown' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}; compiles after warm-up "
        f"{train_warm}, at the end {train_end}"
    )
    decode, decode_end = "na", 0
    if time.perf_counter() - started < args.budget_s * 2 / 3:
        decode_s, decode_warm, decode_end = decode_section(cfg, size["prompt"], size["decode"])
        decode = f"{decode_s:.1f}"
        print(f"decode: {decode} tokens/s at concurrency {CONCURRENCY}; compiles after warm-up "
              f"{decode_warm}, at the end {decode_end}")  # fmt: skip
    else:
        print("decode: skipped, too little of --budget-s left")
    qwen = Qwen35Config(**QWEN35_SHAPES[size["qwen35"]])
    chunked_s, recurrent_s, speedup, _ = compare(qwen, 1, size["prefill"], qwen.chunk_size, 3)
    print(
        f"prefill: {size['qwen35']} DeltaNet layer, 1 x {size['prefill']} tokens: chunked "
        f"{chunked_s * 1e3:.2f} ms, recurrent {recurrent_s * 1e3:.2f} ms"
    )
    print(
        f"device: platform={device.platform} kind={device.device_kind.replace(' ', '_')} mfu={mfu} "
        f"train_tokens_s={train_s:.1f} decode_tokens_s={decode} compiles_train={train_end} "
        f"compiles_decode={decode_end} prefill_speedup={speedup:.2f}"
    )


if __name__ == "__main__":
    keep_freed_memory()
    main()
