"""Decoder: KV-cache path equals the full forward, packed rows equal unpacked, padding and mesh.

The paths compared compute the same float32 function with differently shaped sums, so they are
held to `reorder_tolerance`: a few ulps of the logits' scale per layer and reduction length.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_bounds import assert_reordered_close, logprob_reorder_tolerance

from harnessrl.model import attention as attn
from harnessrl.model.cache import KVCache
from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.families.dense.decoder import Decoder

FAMILIES = {
    "llama": {},
    "qwen2": {"family": "qwen2", "qkv_bias": True},
    "qwen3": {"family": "qwen3", "qk_norm": True, "tie_word_embeddings": True},
}


# Jitted entry points: eager calls would re-trace and re-compile the layer scan every time.
_forward = nnx.jit(lambda m, t, p, s=None: m(t, p, s))
_decode = nnx.jit(lambda m, t, p, c: m.decode(t, p, c))
# One slot's chunk attending over the first 8 cache positions, logits at index `last` only.
_decode_slot = nnx.jit(lambda m, t, p, c, s, last: m.decode(t, p, c, slot=s, length=8, last=last))
_decode_8 = nnx.jit(lambda m, t, p, c: m.decode(t, p, c, length=8))


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
    assert_reordered_close(np.concatenate(chunks, axis=1), full_btv, model.cfg, 16)


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
    assert_reordered_close(logits[0], alone_a[0], model.cfg, 12)
    assert_reordered_close(logits[1, :4], alone_b[0], model.cfg, 12)
    assert np.isfinite(np.asarray(logits)).all()
    # Next step: row 0 idles (position -1), row 1 decodes one token at position 4.
    nxt = jnp.asarray([[0], [7]], jnp.int32)
    logits, cache = _decode(model, nxt, jnp.asarray([[-1], [4]], jnp.int32), cache)
    want = _forward(model, jnp.concatenate([seq_b, nxt[1:]], axis=1), jnp.arange(5)[None])
    assert_reordered_close(logits[1, 0], want[0, -1], model.cfg, 12)


def test_one_slot_chunk_and_short_length_match_full_forward() -> None:
    model = _model()
    rng = np.random.default_rng(4)
    seq = jnp.asarray(rng.integers(0, 128, (1, 7)), jnp.int32)
    full = _forward(model, seq, jnp.arange(7)[None])
    # Every slot starts with stale random entries: only the written ones may change.
    shape = (model.cfg.num_layers, 3, 16, model.cfg.num_kv_heads, model.cfg.head_dim)
    k, v = jax.random.normal(jax.random.key(0), (2, *shape))
    before = KVCache(k_lbske=k, v_lbske=v)
    # Prefill 6 tokens into slot 2 as a chunk of 8 padded with -1; logits of token 5 only.
    tokens = jnp.pad(seq[:, :6], ((0, 0), (0, 2)))
    positions = jnp.asarray([[0, 1, 2, 3, 4, 5, -1, -1]], jnp.int32)
    logits, cache = _decode_slot(model, tokens, positions, before, jnp.int32(2), jnp.int32(5))
    assert logits.shape == (1, 1, 128)
    assert_reordered_close(logits[0, 0], full[0, 5], model.cfg, 16)
    for got, old in ((cache.k_lbske, k), (cache.v_lbske, v)):
        np.testing.assert_array_equal(got[:, :2], old[:, :2])
        np.testing.assert_array_equal(got[:, 2, 6:], old[:, 2, 6:])
        assert not np.allclose(got[:, 2, :6], old[:, 2, :6])
    # A batched step over all slots, attending over 8 positions: slot 2 decodes token 6.
    nxt = jnp.asarray([[0], [0], [seq[0, 6]]], jnp.int32)
    logits_8, cache_8 = _decode_8(model, nxt, jnp.asarray([[-1], [-1], [6]], jnp.int32), cache)
    assert_reordered_close(logits_8[2, 0], full[0, 6], model.cfg, 16)
    logits_16, cache_16 = _decode(model, nxt, jnp.asarray([[-1], [-1], [6]], jnp.int32), cache)
    # The 8 extra positions are masked to exact zeros: only the sums' blocking can differ, in the
    # logits and in what the step wrote (index 6 of slot 2: past the first layer, its keys and
    # values come from attention over 8 vs 16 positions). Everything else is the cache as it was.
    assert_reordered_close(logits_8[2], logits_16[2], model.cfg, 16)
    for short, long, old in (
        (cache_8.k_lbske, cache_16.k_lbske, cache.k_lbske),
        (cache_8.v_lbske, cache_16.v_lbske, cache.v_lbske),
    ):
        assert_reordered_close(short[:, 2, 6], long[:, 2, 6], model.cfg, 16)
        for kept in (short, long):
            written = np.zeros(kept.shape, bool)
            written[:, 2, 6] = True
            np.testing.assert_array_equal(np.asarray(kept)[~written], np.asarray(old)[~written])


def test_donated_cache_is_updated_in_place() -> None:
    model = _model()
    graphdef, state = nnx.split(model)
    step = jax.jit(
        lambda s, t, p, c: nnx.merge(graphdef, s).decode(t, p, c, length=4), donate_argnums=3
    )
    cache = KVCache.create(model.cfg, slots=2, max_len=8)
    pointers = (cache.k_lbske.unsafe_buffer_pointer(), cache.v_lbske.unsafe_buffer_pointer())
    tokens, positions = jnp.asarray([[3], [4]], jnp.int32), jnp.asarray([[0], [-1]], jnp.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "donated buffers were not usable" would fail here
        _, new = step(state, tokens, positions, cache)
    assert cache.k_lbske.is_deleted() and cache.v_lbske.is_deleted()
    assert (new.k_lbske.unsafe_buffer_pointer(), new.v_lbske.unsafe_buffer_pointer()) == pointers
    assert np.abs(np.asarray(new.k_lbske[:, 0, 0])).sum() > 0
    assert not np.asarray(new.k_lbske[:, 1]).any() and not np.asarray(new.k_lbske[:, 0, 1:]).any()


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
    scale = float(np.abs(np.asarray(logits)).max())
    tol = logprob_reorder_tolerance(model.cfg, scale, tokens.shape[1])
    start = 0
    for n, want in zip(lengths, alone, strict=True):
        got = _logprobs(logits[:, start : start + n], tokens[:, start : start + n])[0]
        assert np.abs(got - want).max() <= tol, (np.abs(got - want).max(), tol)
        start += n


WINDOW, CHUNK, SLOTS, MAX_LEN = 8, 16, 4, 32
_write_slot = nnx.jit(lambda m, t, p, c, s: m.decode(t, p, c, slot=s))
_packed_held = nnx.jit(
    lambda m, t, p, seg, sl, c, last, held: m.prefill_packed(
        t, p, seg, sl, c, last_n=last, held_n=held, window=WINDOW
    )
)
_HELD_MODEL = _model()


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_packed_prefill_after_held_prefixes_matches_full_forward(data: st.DataObject) -> None:
    """Prompts packed in one chunk, each resuming after 0..WINDOW tokens its slot holds, get the
    full forward's last logits; the held entries stay as they were, other slots' stale ones too."""
    model = _HELD_MODEL
    n = data.draw(st.integers(1, 3), label="prompts")
    slots = data.draw(st.permutations(range(SLOTS)), label="slots")[:n]
    held = [data.draw(st.integers(0, WINDOW), label="held") for _ in range(n)]
    new = [data.draw(st.integers(1, 5), label="new") for _ in range(n)]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    seqs = [rng.integers(0, 128, h + k).astype(np.int32) for h, k in zip(held, new, strict=True)]
    shape = (model.cfg.num_layers, SLOTS, MAX_LEN, model.cfg.num_kv_heads, model.cfg.head_dim)
    cache = KVCache(*jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (2, *shape)))
    for slot, h, seq in zip(slots, held, seqs, strict=True):  # what each slot holds
        tokens, positions = np.zeros((1, WINDOW), np.int32), np.full((1, WINDOW), -1, np.int32)
        tokens[0, :h], positions[0, :h] = seq[:h], np.arange(h)
        _, cache = _write_slot(model, tokens, positions, cache, jnp.int32(slot))
    before = jax.tree.map(np.asarray, cache)
    tokens, positions, segments, slots_c = (np.zeros((1, CHUNK), np.int32) for _ in range(4))
    last_n, held_n = np.zeros(SLOTS, np.int32), np.zeros(SLOTS, np.int32)
    at = 0
    for i, (slot, h, seq) in enumerate(zip(slots, held, seqs, strict=True)):
        end = at + len(seq) - h
        tokens[0, at:end], positions[0, at:end] = seq[h:], np.arange(h, len(seq))
        segments[0, at:end], slots_c[0, at:end], last_n[i], held_n[i] = i + 1, slot, end - 1, h
        at = end
    logits, after = _packed_held(model, tokens, positions, segments, slots_c, cache, last_n, held_n)
    for i, seq in enumerate(seqs):
        full = _forward(model, jnp.asarray(seq[None]), jnp.arange(len(seq))[None])
        assert_reordered_close(logits[0, i], full[0, -1], model.cfg, MAX_LEN)
    written = np.zeros((SLOTS, MAX_LEN), bool)
    for slot, h, seq in zip(slots, held, seqs, strict=True):
        written[slot, h : len(seq)] = True
    for got, old in ((after.k_lbske, before.k_lbske), (after.v_lbske, before.v_lbske)):
        np.testing.assert_array_equal(np.asarray(got)[:, ~written], old[:, ~written])


def test_causal_query_blocks_cover_the_lengths_the_learner_packs() -> None:
    assert [attn.causal_query_blocks(n) for n in (64, 100, 128, 192, 256, 1024, 4096)] == [
        1, 1, 2, 3, 4, 8, 8,
    ]  # fmt: skip
    q = jnp.zeros((1, 6, 4, 8))
    with pytest.raises(ValueError, match="causal_query_blocks"):
        attn.attend(q, q[:, :, :2], q[:, :, :2], jnp.ones((1, 6, 6), bool), causal_blocks=4)


def test_causal_blocks_give_the_one_block_outputs_and_gradients() -> None:
    """Query blocks that skip the keys above the diagonal: the same attention and VJP, on packed
    segments that cross the block boundaries."""
    rng = np.random.default_rng(5)
    b, t, h, k, e = 2, 256, 4, 2, 16
    q, kk, v, d_out = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in ((b, t, h, e), (b, t, k, e), (b, t, k, e), (b, t, h, e))
    )
    cuts = np.sort(rng.choice(np.arange(1, t), 5, replace=False))
    segments = jnp.asarray(np.tile(np.searchsorted(cuts, np.arange(t), side="right"), (b, 1)))
    mask = attn.segment_causal_mask(segments)

    def vjp(blocks: int) -> tuple[jax.Array, ...]:
        out, pull = jax.vjp(lambda *qkv: attn.attend(*qkv, mask, causal_blocks=blocks), q, kk, v)
        return (out, *pull(d_out))

    whole = jax.jit(lambda: vjp(1))()
    blocked = jax.jit(lambda: vjp(attn.causal_query_blocks(t)))()
    cfg = ModelConfig.tiny(num_layers=1)
    for got, want in zip(blocked, whole, strict=True):
        assert_reordered_close(np.asarray(got), np.asarray(want), cfg, t)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tied_head_gradients_are_autodiffs(dtype: jnp.dtype) -> None:
    """`tied_head_logits`' own VJP gives what autodiff of `dense(h, embed.T)` gives."""
    rng = np.random.default_rng(6)
    h = jnp.asarray(rng.standard_normal((2, 8, 32)), dtype)
    embed = jnp.asarray(rng.standard_normal((96, 32)), dtype)
    d_logits = jnp.asarray(rng.standard_normal((2, 8, 96)), jnp.float32)

    def grads(logits: object) -> tuple[jax.Array, ...]:
        out, pull = jax.vjp(logits, h, embed)  # type: ignore[arg-type]
        return (out, *pull(d_logits))

    ours = jax.jit(lambda: grads(lambda x, w: attn.tied_head_logits(x, w, jnp.float32)))()
    autodiff = jax.jit(lambda: grads(lambda x, w: attn.dense(x, w.T, out_dtype=jnp.float32)))()
    cfg = ModelConfig.tiny(num_layers=1)
    for got, want in zip(ours, autodiff, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert_reordered_close(np.asarray(got, np.float32), np.asarray(want, np.float32), cfg, 16)


def test_remat_and_bf16_policy() -> None:
    tokens = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    positions = jnp.arange(4, dtype=jnp.int32)[None]
    base = _model()
    remat = _model(remat=True)

    def loss(m: Decoder) -> jax.Array:
        return jnp.sum(m(tokens, positions) ** 2)

    g0 = nnx.jit(nnx.grad(loss))(base)
    g1 = nnx.jit(nnx.grad(loss))(remat)
    # Remat recomputes the same forward; XLA may fuse it differently, so only summation order
    # changes. The backward pass reduces over tokens too, within the same `n` here.
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        assert_reordered_close(b, a, base.cfg, 4)
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
    one, two = jnp.zeros((1, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32)
    with pytest.raises(ValueError, match="slot=1 takes one row, got 2"):
        model.decode(two, two, cache, slot=1)
    for length in (0, 5, 2.0):
        with pytest.raises(ValueError, match=f"length={length!r} must be a static int in 1..4"):
            model.decode(
                jnp.zeros((3, 1), jnp.int32), jnp.zeros((3, 1), jnp.int32), cache, length=length
            )
    assert model.decode(one, one, cache, slot=2, length=4)[0].shape == (1, 1, 128)


def test_params_carry_logical_axes_and_shard_under_a_mesh(xla_cache_env: dict[str, str]) -> None:
    from harnessrl.model.sharding import LOGICAL_AXES

    model = _model()
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        axes = var.get_metadata()["out_sharding"]
        assert len(axes) == var[...].ndim and set(axes) <= set(LOGICAL_AXES)
    # The mesh's owner hands in the rules: the learner's table, or any other table, which the
    # model then follows; a mesh without rules is refused with the way to fix it.
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        from flax import nnx
        from harnessrl.learner.mesh import make_mesh, use_mesh
        from harnessrl.model.families.dense.config import ModelConfig
        from harnessrl.model.families.dense.decoder import Decoder
        mesh = make_mesh("fsdp_tp")
        with use_mesh(mesh):
            model = Decoder(ModelConfig.tiny(), rngs=nnx.Rngs(0))
            spec = model.layers.w_gate_ldf[...].sharding.spec
            assert tuple(spec) == (None, "fsdp", "tensor"), spec
            tokens = jnp.zeros((8, 6), jnp.int32)
            out = nnx.jit(lambda m, t: m(t, jnp.tile(jnp.arange(6), (8, 1))))(model, tokens)
            assert out.shape == (8, 6, 128)
            from harnessrl.model.formats.export import params_numpy
            from harnessrl.model.formats.load import build_decoder
            rebuilt = build_decoder(model.cfg, params_numpy(model))
            spec = rebuilt.layers.wq_ldhe[...].sharding.spec
            assert tuple(spec) == (None, "fsdp", "tensor", None), spec
        swapped = [("embed", "tensor"), ("mlp", "fsdp"), ("heads", "fsdp"), ("kv_heads", None),
                   ("head_dim", None), ("vocab", None), ("layers", None), ("batch", "data"),
                   ("length", None)]
        with jax.set_mesh(mesh), nnx.logical_axis_rules(swapped):
            other = build_decoder(model.cfg, params_numpy(model))
            spec = other.layers.w_gate_ldf[...].sharding.spec
            assert tuple(spec) == (None, "tensor", "fsdp"), spec
            spec = other.layers.wq_ldhe[...].sharding.spec
            assert tuple(spec) == (None, "tensor", "fsdp", None), spec
        with jax.set_mesh(mesh):
            try:
                Decoder(ModelConfig.tiny(), rngs=nnx.Rngs(0))
            except ValueError as err:
                assert "no logical-axis rules" in str(err), err
            else:
                raise AssertionError("a mesh without rules was accepted")
        print("ok")
        """
    )
    # Eight CPU devices whatever accelerator the host has: the mesh is sized to what JAX sees.
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
        "--xla_force_host_platform_device_count=8".strip(),
        "JAX_PLATFORMS": "cpu",
        **xla_cache_env,
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
