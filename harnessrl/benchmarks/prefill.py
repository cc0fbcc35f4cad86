"""Benchmark: a Qwen3.5 prompt chunk through the gated delta rule, chunked against token by token.

The embedded server prefills a Qwen3.5 prompt chunk by the chunked delta rule the learner trains
with (`gated_deltanet.chunked_gated_delta_rule`, continuing the slot's state), and decodes by the
recurrence (`recurrent_gated_delta_rule`, one sequential step per token). This times both on the
same prompt chunk in one run, at one DeltaNet layer of a named shape's widths (`--shape`,
`qwen3_5-9b-shape` by default: 32 value heads of 128, keys 128), `--rows` slots of `--length`
tokens continuing a nonzero state, float32, jitted; each round times one call of each, back to
back. It checks that both give the same output and final state within float32 reordering.
Last line: `prefill: chunked_tokens_per_s=<x> recurrent_tokens_per_s=<y> speedup=<x/y>
max_abs_diff=<d>`; speedup is the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from harnessrl.benchmarks.model import side_by_side
from harnessrl.host_memory import keep_freed_memory
from harnessrl.model.families.qwen3_5 import SHAPES as QWEN35_SHAPES
from harnessrl.model.families.qwen3_5 import Qwen35Config
from harnessrl.model.families.qwen3_5 import gated_deltanet as gdn


def mixer_inputs(cfg: Qwen35Config, rows: int, length: int, seed: int = 0) -> tuple[jax.Array, ...]:
    """q, k (normalized), v, g, beta `[rows, length, heads, ...]` and a slot state, as one
    DeltaNet layer of `cfg` hands them to the delta rule."""
    rng = np.random.default_rng(seed)
    h, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    q = gdn.l2_normalize(normal(rows, length, h, dk)) * dk**-0.5
    k = gdn.l2_normalize(normal(rows, length, h, dk))
    g = -jnp.asarray(rng.uniform(0.01, 1.0, (rows, length, h)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (rows, length, h)), jnp.float32)
    return q, k, normal(rows, length, h, dv), g, beta, normal(rows, h, dk, dv) * 0.1


def compare(
    cfg: Qwen35Config, rows: int, length: int, chunk: int, repeats: int
) -> tuple[float, float, float, float]:
    """(chunked seconds, recurrent seconds, the rounds' median speedup, max |difference|)."""
    q, k, v, g, beta, state = mixer_inputs(cfg, rows, length)
    one_run = jnp.zeros((rows, length), jnp.int32)
    continues = jnp.ones((rows, length), jnp.float32)
    chunked = jax.jit(
        lambda q, k, v, g, beta: gdn.chunked_gated_delta_rule(
            q, k, v, g, beta, one_run, chunk, state
        )
    )
    recurrent = jax.jit(
        lambda q, k, v, g, beta: gdn.recurrent_gated_delta_rule(q, k, v, g, beta, state, continues)
    )
    inputs = (q, k, v, g, beta)
    seconds, recurrent_seconds, speedup = side_by_side(
        lambda: chunked(*inputs), lambda: recurrent(*inputs), repeats
    )
    # Checked in full float32: a GPU's default float32 dot (TF32) rounds far above the bound.
    with jax.default_matmul_precision("highest"):
        (o_c, s_c), (o_r, s_r) = chunked(*inputs), recurrent(*inputs)
    diff = max(float(jnp.abs(o_c - o_r).max()), float(jnp.abs(s_c - s_r).max()))
    # Both are float32 sums of `length` terms of the state's scale, in different orders.
    scale = max(float(jnp.abs(o_r).max()), float(jnp.abs(s_r).max()))
    bound = 4 * np.sqrt(length * cfg.linear_key_head_dim) * np.finfo(np.float32).eps * scale
    if diff > bound:
        raise AssertionError(f"chunked and recurrent differ by {diff:.3g} > {bound:.3g}")
    return seconds, recurrent_seconds, speedup, diff


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--shape", default="qwen3_5-9b-shape", help=f"one of {sorted(QWEN35_SHAPES)}"
    )
    parser.add_argument("--rows", type=int, default=1, help="slots prefilled in one call")
    parser.add_argument("--length", type=int, default=256, help="prompt chunk length")
    parser.add_argument("--chunk", type=int, help="chunk size (default: the config's)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds")
    args = parser.parse_args(argv)
    if args.shape not in QWEN35_SHAPES:
        parser.error(f"--shape {args.shape!r}: choose from {sorted(QWEN35_SHAPES)}")
    if args.rows < 1 or args.length < 2 or args.repeats < 1:
        parser.error(
            f"need --rows >= 1, --length >= 2, --repeats >= 1; got {args.rows}, {args.length}, "
            f"{args.repeats}"
        )
    cfg = Qwen35Config(**QWEN35_SHAPES[args.shape])
    chunk = args.chunk or cfg.chunk_size
    print(
        f"device: {jax.devices()[0].device_kind}; one DeltaNet layer of {args.shape}: "
        f"{cfg.linear_num_value_heads} value heads, key {cfg.linear_key_head_dim}, value "
        f"{cfg.linear_value_head_dim}; {args.rows} x {args.length} tokens, chunk {chunk}, float32"
    )
    seconds, recurrent_seconds, speedup, diff = compare(
        cfg, args.rows, args.length, chunk, args.repeats
    )
    n = args.rows * args.length
    print(f"chunked:   {seconds * 1e3:8.2f} ms  {n / seconds:10.1f} tokens/s")
    print(f"recurrent: {recurrent_seconds * 1e3:8.2f} ms  {n / recurrent_seconds:10.1f} tokens/s")
    print(
        f"prefill: chunked_tokens_per_s={n / seconds:.1f} "
        f"recurrent_tokens_per_s={n / recurrent_seconds:.1f} speedup={speedup:.2f} "
        f"max_abs_diff={diff:.2e}"
    )


if __name__ == "__main__":
    keep_freed_memory()
    main()
