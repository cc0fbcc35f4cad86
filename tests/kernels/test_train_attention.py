"""The learner's CPU attention kernel: forward and gradients against a float64 evaluation of the
same masked attention, within bounds set by XLA's own float32 error on the same input; the
learner choosing it where it applies; and its errors on shapes it does not serve."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.data.pack import PackedBatch
from harnessrl.kernels import build
from harnessrl.kernels import train_attention as kernel
from harnessrl.learner.config import LearnerConfig
from harnessrl.learner.mesh import make_mesh
from harnessrl.learner.step import Learner, train_attention
from harnessrl.model import attention
from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.families.dense.decoder import Decoder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from reference_bounds import EPS32, GRADIENT_ERROR_RATIO, reference_bounds

pytestmark = pytest.mark.skipif(
    not build.load(), reason="the CPU kernels need an x86-64 CPU backend and a C++ compiler"
)


def exact_attention(q, k, v, seg, d_out):
    """Float64 masked attention and its gradients, from the formulas (no blocking, no shortcuts)."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    g = q.shape[2] // k.shape[2]
    k_rep, v_rep = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # head h reads kv head h // g
    scale = 1.0 / np.sqrt(q.shape[-1])
    t = q.shape[1]
    mask = (seg[:, :, None] == seg[:, None, :]) & np.tril(np.ones((t, t), bool))[None]
    scores = np.einsum("bthe,bshe->bhts", q, k_rep) * scale
    scores = np.where(mask[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bhts,bshe->bthe", probs, v_rep)
    d_probs = np.einsum("bthe,bshe->bhts", d_out, v_rep)
    d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdims=True)) * scale
    d_q = np.einsum("bhts,bshe->bthe", d_scores, k_rep)
    d_k_rep = np.einsum("bhts,bthe->bshe", d_scores, q)
    d_v_rep = np.einsum("bhts,bthe->bshe", probs, d_out)
    fold = lambda x: x.reshape(*x.shape[:2], k.shape[2], g, x.shape[-1]).sum(3)  # noqa: E731
    return out, d_q, fold(d_k_rep), fold(d_v_rep)


def value_and_grads(fn, q, k, v, seg, d_out):
    out, pull = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
    return (out, *pull(d_out))


def xla_attention(q, k, v, seg):
    return attention.attend(q, k, v, attention.segment_causal_mask(seg))


@st.composite
def segments(draw, rows: int, length: int) -> np.ndarray:
    """Packed rows (contiguous runs, as packing makes them) or arbitrary ids (any layout)."""
    if draw(st.booleans()):
        ids = st.lists(st.integers(0, 3), min_size=length, max_size=length)
        return np.array([draw(ids) for _ in range(rows)], np.int32)
    out = np.zeros((rows, length), np.int32)
    for r in range(rows):
        cuts = draw(st.lists(st.integers(1, max(1, length - 1)), max_size=4, unique=True))
        for cut in sorted(c for c in cuts if c < length):
            out[r, cut:] += 1
    return out


@settings(max_examples=15, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 2),
    length=st.integers(1, 70),  # below and past whole 16-key vectors, past one 32-query task
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([64, 128]),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_float64_attention_and_gradients(
    data, rows, length, kv_heads, group, head_dim, seed
):
    rng = np.random.default_rng(seed)
    heads = kv_heads * group
    q = rng.normal(size=(rows, length, heads, head_dim)).astype(np.float32)
    k = rng.normal(size=(rows, length, kv_heads, head_dim)).astype(np.float32)
    v = rng.normal(size=(rows, length, kv_heads, head_dim)).astype(np.float32)
    d_out = rng.normal(size=q.shape).astype(np.float32)
    seg = data.draw(segments(rows, length))
    exact = exact_attention(q, k, v, seg, d_out)
    ours = value_and_grads(kernel.segment_attention, q, k, v, seg, d_out)
    xla = value_and_grads(xla_attention, q, k, v, seg, d_out)
    # d_q and d_k go through dS = P (dP - rowsum(dO * O)), a difference of two e-term dot products
    # of dO and v that can cancel to exactly 0 (one visible key); each rounds by at most
    # e eps/2 max|dO| max|v|, and dS meets k or q scaled by 1/sqrt(e): that is their floor.
    big = lambda x: float(np.abs(x).max())  # noqa: E731
    cancel = np.sqrt(head_dim) * EPS32 * big(d_out) * big(v) * max(big(q), big(k))
    floors = {"out": 0.0, "d_q": cancel, "d_k": cancel, "d_v": 0.0}
    for name, mine, theirs, want in zip(
        ("out", "d_q", "d_k", "d_v"), ours, xla, exact, strict=True
    ):
        _, bound, _ = reference_bounds(np.asarray(theirs), want, GRADIENT_ERROR_RATIO)
        bound += floors[name]
        err = float(np.abs(np.asarray(mine, np.float64) - want).max())
        assert err <= bound, f"{name}: {err:.3g} from float64, bound {bound:.3g}"


def test_kernel_rejects_shapes_it_does_not_serve():
    q = jnp.zeros((1, 8, 2, 32))  # head_dim 32: not a multiple of 64
    with pytest.raises(ValueError, match="multiple of 64"):
        kernel.segment_attention(q, q, q, jnp.ones((1, 8), jnp.int32))
    q = jnp.zeros((1, 8, 2, 64))
    with pytest.raises(ValueError, match="segment_ids"):
        kernel.segment_attention(q, q, q, jnp.ones((1, 9), jnp.int32))
    assert not kernel.usable(32, "float32")
    assert not kernel.usable(64, "bfloat16")
    assert not kernel.usable(64, "float32", backend="tpu")
    assert kernel.usable(64, "float32", backend="cpu")


def _tiny(head_dim: int = 64) -> Decoder:
    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
    )
    return Decoder(cfg, rngs=nnx.Rngs(0))


def _batch(rows: int = 2, length: int = 48) -> PackedBatch:
    rng = np.random.default_rng(1)
    seg = np.ones((rows, length), np.int32)
    seg[:, 20:] = 2
    positions = np.concatenate([np.arange(20), np.arange(length - 20)])[None].repeat(rows, 0)
    mask = (positions > 0).astype(np.float32)
    return PackedBatch(
        tokens=rng.integers(0, 96, (rows, length)).astype(np.int32),
        positions=positions.astype(np.int32),
        segment_ids=seg,
        loss_mask=mask,
        behavior_logprobs=np.full((rows, length), -4.0, np.float32),
        advantages=np.where(np.arange(rows)[:, None] % 2, 1.0, -1.0).astype(np.float32) * mask,
        token_weights=mask / mask.sum(),
    )


def test_learner_uses_the_kernel_where_it_applies_and_trains_alike():
    single = make_mesh("data=1,fsdp=1,tensor=1", devices=jax.devices()[:1])
    assert train_attention(LearnerConfig(), _tiny(), single) is kernel.segment_attention
    assert train_attention(LearnerConfig(cpu_attention=False), _tiny(), single) is None
    assert train_attention(LearnerConfig(compute_dtype="bfloat16"), _tiny(), single) is None
    assert train_attention(LearnerConfig(), _tiny(head_dim=32), single) is None
    metrics = {}
    for on in (True, False):
        cfg = LearnerConfig(learning_rate=1e-3, cpu_attention=on)
        learner = Learner(_tiny(), cfg, mesh=single)
        assert (learner.attention is not None) == on
        metrics[on] = learner.train_step([_batch()])
    # Same step through either attention: the gradient norm is a sum over every parameter's
    # gradient, so float32 reordering moves it by ~1e-6 relative; a wrong mask moves it by 1e-1.
    for name in ("loss", "logprob", "entropy", "grad_norm"):
        np.testing.assert_allclose(metrics[True][name], metrics[False][name], rtol=1e-4)
