"""Benchmark: the learner's CPU attention kernel against XLA's attention, forward+backward, same run.

One layer's attention over a packed micro-batch (SmolLM2's 9 query and 3 KV heads of 64 by
default; rows of 2-4 segments as packing makes them, from the learner benchmark): the C++ kernel
(`harnessrl.kernels.train_attention`) and `attention.attend` over the segment-causal mask with
its causal query blocks, each jitted as value and VJP. Rounds alternate between the two, so a
change in the host's load hits both; each side's time is the median over the rounds.
Last line: `train_attention: speedup=<x> ms_kernel=<a> ms_xla=<b>` (speedup: XLA's median time
over the kernel's).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from harnessrl.benchmarks.learner import packed_batch
from harnessrl.kernels import build
from harnessrl.kernels.train_attention import segment_attention
from harnessrl.model import attention


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> jax.Array:
    mask = attention.segment_causal_mask(seg)
    return attention.attend(q, k, v, mask, causal_blocks=attention.causal_query_blocks(q.shape[1]))


def fwd_bwd(fn: Callable[..., jax.Array]) -> Callable[..., tuple[jax.Array, ...]]:
    @jax.jit
    def step(
        q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, d_out: jax.Array
    ) -> tuple[jax.Array, ...]:
        out, pull = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
        return (out, *pull(d_out))

    return step


def seconds(step: Callable[[], object]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(step())
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m harnessrl.benchmarks.train_attention", description=__doc__
    )
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    if args.rows < 1 or args.length < 40 or args.rounds < 1:
        parser.error("need --rows >= 1, --length >= 40 (packing cuts rows) and --rounds >= 1")
    if args.heads % args.kv_heads or args.head_dim % 64:
        parser.error("--heads must be a multiple of --kv-heads, --head-dim a multiple of 64")
    if not build.load():
        raise SystemExit("train_attention: the kernel cannot run here (see the log line above)")
    rng = np.random.default_rng(0)
    b, t, e = args.rows, args.length, args.head_dim

    def normal(*shape: int) -> jax.Array:
        return jax.numpy.asarray(rng.normal(size=shape), jax.numpy.float32)

    q, d_out = normal(b, t, args.heads, e), normal(b, t, args.heads, e)
    k, v = normal(b, t, args.kv_heads, e), normal(b, t, args.kv_heads, e)
    seg = jax.numpy.asarray(packed_batch(b, t, 2)["segment_ids"])
    steps = {"kernel": fwd_bwd(segment_attention), "xla": fwd_bwd(xla_attention)}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        jax.block_until_ready(step(q, k, v, seg, d_out))  # compile
    for _ in range(args.rounds):
        for name, step in steps.items():
            times[name].append(seconds(functools.partial(step, q, k, v, seg, d_out)))
    ms = {name: 1e3 * statistics.median(values) for name, values in times.items()}
    print(
        f"one layer, {b}x{t} packed tokens, {args.heads} query / {args.kv_heads} KV heads of {e}: "
        f"forward+backward kernel {ms['kernel']:.2f} ms, XLA {ms['xla']:.2f} ms "
        f"(medians of {args.rounds} alternating rounds)"
    )
    print(
        f"train_attention: speedup={ms['xla'] / ms['kernel']:.2f} "
        f"ms_kernel={ms['kernel']:.3f} ms_xla={ms['xla']:.3f}"
    )


if __name__ == "__main__":
    main()
