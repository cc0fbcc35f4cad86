"""The decode matmul kernel: float32 dot products of float32 or bfloat16-word weights read in place
from stacked arrays, the decoder's serving step through it, and where it falls back to XLA."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.engine import cpu_kernels
from harnessrl.engine.steps import DeviceSteps
from harnessrl.model import attention, bf16_bits
from harnessrl.model.cache import KVCache
from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.families.dense.decoder import Decoder
from harnessrl.serve.config import ServeConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from reference_bounds import EPS32, assert_reordered_close

pytestmark = pytest.mark.skipif(
    not cpu_kernels.load(), reason="the CPU kernels need an x86-64 CPU backend and a C++ compiler"
)


@functools.partial(jax.jit, static_argnums=3)
def _call(x, w, layer, transposed):
    return cpu_kernels.matvec(x, w, layer, transposed)


def _dot_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Elementwise bound on a float32 dot product's error in any summation order: each of the k
    products and k - 1 additions rounds once, so |error| <= 2 k eps/2 sum |x_i w_i| (to first
    order; the factor 2 covers the second-order terms and FMA's single rounding alike)."""
    k = x.shape[1]
    return 2.0 * k * EPS32 * (np.abs(x) @ np.abs(w)) + np.finfo(np.float32).tiny


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 12),  # past the kernel's 8 register rows: a second row group
    k=st.integers(1, 70),  # odd counts: the two-row step's last row alone
    n=st.integers(1, 70),  # past whole 16-lane vectors: the scalar tail
    layers=st.integers(1, 3),
    transposed=st.booleans(),
    bits=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matvec_equals_the_float64_product_within_float32_dot_error(
    rows, k, n, layers, transposed, bits, seed
):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    w = rng.standard_normal((layers, n, k) if transposed else (layers, k, n), dtype=np.float32)
    stored = bf16_bits.to_bits(jnp.asarray(w)) if bits else jnp.asarray(w)
    exact_w = np.asarray(bf16_bits.widen(stored), np.float64)  # the rounded weights, if bits
    layer = int(rng.integers(layers))
    w_kn = exact_w[layer].T if transposed else exact_w[layer]
    got = np.asarray(_call(x, stored, jnp.int32(layer), transposed), np.float64)
    want = x.astype(np.float64) @ w_kn
    assert got.shape == (rows, n)
    assert np.all(np.abs(got - want) <= _dot_bound(x, w_kn)), np.abs(got - want).max()


def test_matvec_reads_the_named_layer_and_splits_long_slabs():
    # k = 300: several slabs summed across threads; every layer distinct, so a wrong offset shows.
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 300), dtype=np.float32)
    w = rng.standard_normal((4, 300, 96), dtype=np.float32)
    for layer in range(4):
        got = np.asarray(_call(x, jnp.asarray(w), jnp.int32(layer), False), np.float64)
        want = x.astype(np.float64) @ w[layer]
        assert np.all(np.abs(got - want) <= _dot_bound(x, w[layer]))


_attend = jax.jit(cpu_kernels.decode_attention)


def test_the_kernels_refuse_a_layer_or_position_outside_the_cache():
    x, w = jnp.ones((2, 16)), jnp.ones((3, 16, 32))
    with pytest.raises(jax.errors.JaxRuntimeError, match="bad layer index"):
        jax.block_until_ready(_call(x, w, jnp.int32(3), False))
    q, cache = jnp.ones((2, 4, 8)), jnp.ones((3, 2, 6, 2, 8))
    with pytest.raises(jax.errors.JaxRuntimeError, match="bad layer index"):
        jax.block_until_ready(_attend(q, cache, cache, jnp.int32(-1), jnp.asarray([0, 1])))
    with pytest.raises(jax.errors.JaxRuntimeError, match="position past the cache"):
        jax.block_until_ready(_attend(q, cache, cache, jnp.int32(0), jnp.asarray([0, 6])))


def _decoder(seed: int, **overrides) -> Decoder:
    cfg = ModelConfig.tiny(vocab_size=100, eos_token_id=99, **overrides)
    model = Decoder(cfg, rngs=nnx.Rngs(seed))
    head = model.embed_vd if cfg.tie_word_embeddings else model.lm_head_dv
    head[...] = head[...] * 40.0  # logits that span a real range
    return model


@pytest.mark.parametrize("bits", [False, True])
@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": True},
        {"tie_word_embeddings": False, "qkv_bias": True},
        {"qk_norm": True},
    ],
    ids=["tied", "untied+bias", "qk_norm"],
)
def test_decode_through_the_kernel_equals_decode_through_xla_dots(overrides, bits):
    model = _decoder(0, **overrides)
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    if bits:
        state = jax.tree.map(bf16_bits.to_bits, state)
    tokens = jnp.asarray([[3, 17, 42, 5], [7, 8, 9, 98], [1, 2, 3, 4]], jnp.int32)
    positions = jnp.asarray([[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, -1, -1]], jnp.int32)

    @functools.partial(jax.jit, static_argnums=1)
    def step(params, kernel):
        cache = KVCache.create(model.cfg, slots=3, max_len=8)
        decoder = nnx.merge(graphdef, params, rest)
        for t in range(tokens.shape[1]):  # one token per call, as a decode step feeds them
            logits, cache = decoder.decode(
                tokens[:, t : t + 1],
                positions[:, t : t + 1],
                cache,
                kernels=cpu_kernels.KERNELS if kernel else None,
            )
        return logits[:, 0]

    want, got = np.asarray(step(state, False)), np.asarray(step(state, True))
    assert_reordered_close(got[:2], want[:2], model.cfg, length=8)  # rows whose last token is real
    assert np.ptp(want[:2]) > 1.0


def test_the_engine_decodes_through_the_kernels_only_where_configured():
    model = _decoder(0)
    base = {"num_slots": 2, "max_model_len": 32, "prefill_buckets": (16,), "warmup": False}
    assert DeviceSteps(model, ServeConfig(**base))._kernels is cpu_kernels.KERNELS
    assert DeviceSteps(model, ServeConfig(**base, cpu_kernels=False))._kernels is None
    # Past the slots it was measured faster at, XLA's dots stay.
    wide = {**base, "num_slots": cpu_kernels.MAX_SLOTS + 1}
    assert DeviceSteps(model, ServeConfig(**wide))._kernels is None
    # The kernels compute in float32: a bfloat16-compute model keeps XLA's dots.
    half = Decoder(model.cfg.replace(compute_dtype="bfloat16"), rngs=nnx.Rngs(0))
    assert DeviceSteps(half, ServeConfig(**base))._kernels is None


@settings(max_examples=30, deadline=None)
@given(
    slots=st.integers(1, 5),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([4, 16, 20, 64]),  # whole vectors and a scalar tail
    positions=st.lists(st.integers(-1, 11), min_size=5, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_decode_attention_equals_masked_attention_over_the_cache(
    slots, kv_heads, group, head_dim, positions, seed
):
    rng = np.random.default_rng(seed)
    layers, max_len, heads = 2, 12, kv_heads * group
    q = rng.standard_normal((slots, heads, head_dim), dtype=np.float32) * 2
    k, v = (
        rng.standard_normal((layers, slots, max_len, kv_heads, head_dim), dtype=np.float32)
        for _ in range(2)
    )
    pos = np.asarray(positions[:slots], np.int32)
    got = np.asarray(_attend(q, k, v, jnp.int32(1), pos))
    want = np.asarray(
        attention.attend(
            jnp.asarray(q)[:, None],
            jnp.asarray(k[1]),
            jnp.asarray(v[1]),
            attention.cache_mask(jnp.asarray(pos)[:, None], max_len),
        )[:, 0]
    )
    live = pos >= 0
    # Softmax weights sum to 1, so outputs are within float32 reordering of the values' scale.
    tol = 8 * (max_len + head_dim) * EPS32 * float(np.abs(v).max())
    np.testing.assert_allclose(got[live], want[live], rtol=0, atol=tol)
    assert not got[~live].any()  # an idle slot reads nothing
