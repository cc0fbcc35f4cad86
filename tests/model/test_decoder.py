"""Decoder: KV-cache path equals the full forward, packed rows equal unpacked, padding and mesh."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from harnessrl.model.config import ModelConfig
from harnessrl.model.decoder import Decoder, KVCache

FAMILIES = {
    "llama": {},
    "qwen2": {"family": "qwen2", "qkv_bias": True},
    "qwen3": {"family": "qwen3", "qk_norm": True, "tie_word_embeddings": True},
}


# Jitted entry points: eager calls would re-trace and re-compile the layer scan every time.
_forward = nnx.jit(lambda m, t, p, s=None: m(t, p, s))
_decode = nnx.jit(lambda m, t, p, c: m.decode(t, p, c))


def _model(**kw: object) -> Decoder:
    model = Decoder(ModelConfig.tiny(**kw), rngs=nnx.Rngs(0))
    # Perturb every param (norms start at ones, biases at zeros) so all of them matter.
    rng = np.random.default_rng(1)
    state = nnx.state(model, nnx.Param)
    noisy = jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(x.dtype), state)
    nnx.update(model, noisy)
    return model


def _logprobs(logits_btv: jax.Array, tokens_bt: jax.Array) -> np.ndarray:
    lp_btv = jax.nn.log_softmax(logits_btv[:, :-1], axis=-1)
    return np.asarray(jnp.take_along_axis(lp_btv, tokens_bt[:, 1:, None], axis=-1)[..., 0])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cache_decode_matches_full_forward(family: str) -> None:
    model = _model(**FAMILIES[family])
    tokens_bt = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 12)), jnp.int32)
    positions_bt = jnp.tile(jnp.arange(12, dtype=jnp.int32), (2, 1))
    full_btv = _forward(model, tokens_bt, positions_bt)
    cache = KVCache.create(model.cfg, slots=2, max_len=16)
    chunks = []
    logits_btv, cache = _decode(model, tokens_bt[:, :7], positions_bt[:, :7], cache)
    chunks.append(logits_btv)
    for i in range(7, 12):
        logits_btv, cache = _decode(
            model, tokens_bt[:, i : i + 1], positions_bt[:, i : i + 1], cache
        )
        chunks.append(logits_btv)
    np.testing.assert_allclose(np.concatenate(chunks, axis=1), full_btv, atol=1e-5)


def test_cache_rows_are_independent_and_padding_is_ignored() -> None:
    model = _model()
    rng = np.random.default_rng(2)
    seq_a = jnp.asarray(rng.integers(0, 128, (1, 9)), jnp.int32)
    seq_b = jnp.asarray(rng.integers(0, 128, (1, 4)), jnp.int32)
    alone_a = _forward(model, seq_a, jnp.arange(9)[None])
    alone_b = _forward(model, seq_b, jnp.arange(4)[None])
    # Slot 1 first holds a stale, longer sequence: reuse must not leak it.
    cache = KVCache.create(model.cfg, slots=2, max_len=12)
    stale = jnp.asarray(rng.integers(0, 128, (2, 10)), jnp.int32)
    _, cache = _decode(model, stale, jnp.tile(jnp.arange(10), (2, 1)), cache)
    # One call: row 0 prefills 9 tokens, row 1 prefills 4 and pads the rest with position -1.
    tokens = jnp.concatenate([seq_a, jnp.pad(seq_b, ((0, 0), (0, 5)))], axis=0)
    positions = jnp.asarray([list(range(9)), [0, 1, 2, 3] + [-1] * 5], jnp.int32)
    logits, cache = _decode(model, tokens, positions, cache)
    np.testing.assert_allclose(logits[0], alone_a[0], atol=1e-5)
    np.testing.assert_allclose(logits[1, :4], alone_b[0], atol=1e-5)
    assert np.isfinite(np.asarray(logits)).all()
    # Next step: row 0 idles (position -1), row 1 decodes one token at position 4.
    nxt = jnp.asarray([[0], [7]], jnp.int32)
    logits, cache = _decode(model, nxt, jnp.asarray([[-1], [4]], jnp.int32), cache)
    want = _forward(model, jnp.concatenate([seq_b, nxt[1:]], axis=1), jnp.arange(5)[None])
    np.testing.assert_allclose(logits[1, 0], want[0, -1], atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_equals_unpacked(family: str) -> None:
    model = _model(**FAMILIES[family])
    rng = np.random.default_rng(3)
    lengths = [5, 9, 3]
    seqs = [jnp.asarray(rng.integers(0, 128, (1, n)), jnp.int32) for n in lengths]
    alone = [_logprobs(_forward(model, s, jnp.arange(s.shape[1])[None]), s)[0] for s in seqs]
    pad = 3
    tokens = jnp.concatenate([*seqs, jnp.zeros((1, pad), jnp.int32)], axis=1)
    positions = jnp.concatenate([jnp.arange(n) for n in lengths] + [jnp.zeros(pad, int)])[None]
    segments = jnp.concatenate(
        [jnp.full(n, i + 1) for i, n in enumerate(lengths)] + [jnp.zeros(pad, int)]
    )[None]
    logits = _forward(model, tokens, positions.astype(jnp.int32), segments.astype(jnp.int32))
    assert np.isfinite(np.asarray(logits)).all()
    start = 0
    for n, want in zip(lengths, alone, strict=True):
        got = _logprobs(logits[:, start : start + n], tokens[:, start : start + n])[0]
        np.testing.assert_allclose(got, want, atol=1e-5)
        start += n


def test_remat_and_bf16_policy() -> None:
    tokens = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    positions = jnp.arange(4, dtype=jnp.int32)[None]
    base = _model()
    remat = _model(remat=True)

    def loss(m: Decoder) -> jax.Array:
        return jnp.sum(m(tokens, positions) ** 2)

    g0 = nnx.jit(nnx.grad(loss))(base)
    g1 = nnx.jit(nnx.grad(loss))(remat)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    bf16 = Decoder(
        ModelConfig.tiny(param_dtype="bfloat16", compute_dtype="bfloat16"), rngs=nnx.Rngs(0)
    )
    assert bf16.layers.wq_ldhe[...].dtype == jnp.bfloat16
    out = _forward(bf16, tokens, positions)
    assert out.dtype == jnp.float32 and np.isfinite(np.asarray(out)).all()


def test_bad_cache_arguments_raise() -> None:
    model = _model()
    with pytest.raises(ValueError, match="slots"):
        KVCache.create(model.cfg, slots=0, max_len=4)
    cache = KVCache.create(model.cfg, slots=3, max_len=4)
    with pytest.raises(ValueError, match="3 slots"):
        _decode(model, jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32), cache)


def test_params_carry_logical_axes_and_shard_under_a_mesh() -> None:
    from harnessrl.learner.mesh import LOGICAL_AXIS_RULES

    model = _model()
    names = {name for (name, _) in LOGICAL_AXIS_RULES}
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        axes = var.get_metadata()["out_sharding"]
        assert len(axes) == var[...].ndim and set(axes) <= names
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        from flax import nnx
        from harnessrl.learner.mesh import make_mesh
        from harnessrl.model.config import ModelConfig
        from harnessrl.model.decoder import Decoder
        with jax.set_mesh(make_mesh("fsdp_tp")):
            model = Decoder(ModelConfig.tiny(), rngs=nnx.Rngs(0))
            spec = model.layers.w_gate_ldf[...].sharding.spec
            assert tuple(spec) == (None, "fsdp", "tensor"), spec
            tokens = jnp.zeros((8, 6), jnp.int32)
            out = nnx.jit(lambda m, t: m(t, jnp.tile(jnp.arange(6), (8, 1))))(model, tokens)
            assert out.shape == (8, 6, 128)
            from harnessrl.model.export import params_numpy
            from harnessrl.model.load import build_decoder
            rebuilt = build_decoder(model.cfg, params_numpy(model))
            spec = rebuilt.layers.wq_ldhe[...].sharding.spec
            assert tuple(spec) == (None, "fsdp", "tensor", None), spec
        print("ok")
        """
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
