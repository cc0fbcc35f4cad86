"""The in-place serving step agrees with `Decoder.decode` (logits and cache), per row and batched."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from harnessrl.model.config import ModelConfig
from harnessrl.model.decoder import Decoder, KVCache
from harnessrl.serve.forward import cached_forward, serve_step

CFG = ModelConfig.tiny(vocab_size=64)
SLOTS, MAX_LEN = 3, 32


def _jit(fn, *static):
    """Run `fn(model, ...)` compiled (eager op-by-op dispatch is slow on a busy CPU)."""

    @functools.partial(jax.jit, static_argnums=(0, *static))
    def run(graphdef, state, *args):
        return fn(nnx.merge(graphdef, state), *args)

    return lambda model, *args: run(*nnx.split(model), *args)


_decode = _jit(lambda m, t, p, c: m.decode(t, p, c))
_serve = _jit(lambda m, t, p, c, r, n: serve_step(m, t, p, c, r, n), 6)


def _cache(seed: int) -> KVCache:
    shape = (CFG.num_layers, SLOTS, MAX_LEN, CFG.num_kv_heads, CFG.head_dim)
    k, v = jax.random.normal(jax.random.key(seed), (2, *shape))
    return KVCache(k_lbske=k, v_lbske=v)


def test_batched_step_matches_decoder_decode():
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    tokens = jnp.asarray([[5], [7], [9]], jnp.int32)
    positions = jnp.asarray([[3], [-1], [10]], jnp.int32)  # slot 1 idle
    want_logits, want = _decode(model, tokens, positions, _cache(0))
    logits, got = _serve(model, tokens, positions, _cache(0), None, 16)
    active = [0, 2]  # an idle row's logits are garbage by contract
    np.testing.assert_allclose(
        np.asarray(logits)[active], np.asarray(want_logits[:, 0])[active], atol=1e-5
    )
    # Written positions agree; an idle row and positions beyond `length` stay as they were.
    np.testing.assert_allclose(np.asarray(got.k_lbske), np.asarray(want.k_lbske), atol=1e-6)
    np.testing.assert_allclose(np.asarray(got.v_lbske), np.asarray(want.v_lbske), atol=1e-6)


def test_one_row_chunk_matches_decode_of_that_row():
    model = Decoder(CFG, rngs=nnx.Rngs(1))
    tokens = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    positions = jnp.asarray([[0, 1, 2, -1]], jnp.int32)
    cache = _cache(1)
    row = KVCache(k_lbske=cache.k_lbske[:, 2:3], v_lbske=cache.v_lbske[:, 2:3])
    want_logits, want_row = _decode(model, tokens, positions, row)
    x, got = cached_forward(model, tokens, positions, cache, jnp.int32(2), 4)
    np.testing.assert_allclose(
        np.asarray(model.logits(x))[0, :3], np.asarray(want_logits)[0, :3], atol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(got.k_lbske[:, 2]), np.asarray(want_row.k_lbske[:, 0]), atol=1e-6
    )
    np.testing.assert_array_equal(np.asarray(got.k_lbske[:, :2]), np.asarray(cache.k_lbske[:, :2]))


class _OwnDecode(Decoder):
    def decode(self, tokens_bt, positions_bt, cache):
        logits_btv, cache = super().decode(tokens_bt, positions_bt, cache)
        return logits_btv + 1.0, cache


def test_subclass_with_its_own_decode_is_served_through_it():
    model = _OwnDecode(CFG, rngs=nnx.Rngs(0))
    plain = Decoder(CFG, rngs=nnx.Rngs(0))
    tokens, positions = (
        jnp.asarray([[5], [7], [9]], jnp.int32),
        jnp.asarray([[3], [4], [5]], jnp.int32),
    )
    own, own_cache = _serve(model, tokens, positions, _cache(2), None, 16)
    base, base_cache = _serve(plain, tokens, positions, _cache(2), None, 16)
    np.testing.assert_allclose(np.asarray(own), np.asarray(base) + 1.0, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(own_cache.k_lbske), np.asarray(base_cache.k_lbske), atol=1e-6
    )
