"""Serving from bfloat16 weights held as bits: exact rounding and widening, the same function as
the float32 model on rounded weights, through the decoder and the engine, and across a swap."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.engine.decode import Engine, TokenEvent
from harnessrl.engine.sampler import SamplingParams
from harnessrl.model import bf16_bits
from harnessrl.model.cache import KVCache
from harnessrl.model.families.dense import decoder
from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.families.dense.decoder import Decoder
from harnessrl.model.families.qwen3_5 import Qwen35Config, Qwen35Decoder
from harnessrl.serve.config import ServeConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from reference_bounds import assert_reordered_close, logprob_reorder_tolerance

VOCAB, EOS = 100, 99
CONFIG = ServeConfig(
    num_slots=2,
    max_model_len=48,
    prefill_buckets=(16,),
    decode_buckets=(48,),
    weight_dtype="bfloat16",
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_bits_round_to_nearest_even_like_ml_dtypes_and_widen_exactly(words: list[int]) -> None:
    # Padded to one length, so the jitted rounding compiles once for every example.
    x = np.zeros(64, np.float32)
    x[: len(words)] = np.asarray(words, np.uint32).view(np.float32)
    want = x.astype(ml_dtypes.bfloat16)
    got = np.asarray(bf16_bits.to_bits(jnp.asarray(x)))
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want.view(np.uint16)[~nan])
    assert np.isnan(got[nan].view(ml_dtypes.bfloat16).astype(np.float32)).all()
    widened = np.asarray(bf16_bits.widen(jnp.asarray(got)))
    assert np.array_equal(widened[~nan], want.astype(np.float32)[~nan])
    same = jnp.asarray(x)
    assert bf16_bits.widen(same) is same  # float32 weights pass through untouched


def _model(seed: int, *, tied: bool) -> Decoder:
    cfg = ModelConfig.tiny(vocab_size=VOCAB, eos_token_id=EOS, tie_word_embeddings=tied)
    model = Decoder(cfg, rngs=nnx.Rngs(seed))
    # Sharpen the near-uniform random logits so logprobs span a real range.
    head = model.embed_vd if tied else model.lm_head_dv
    head[...] = head[...] * 40.0
    return model


def _rounded(model: Decoder) -> Decoder:
    """The float32 model whose weights are the bfloat16 rounding of `model`'s."""
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    state = jax.tree.map(lambda x: bf16_bits.widen(bf16_bits.to_bits(x)), state)
    return nnx.merge(graphdef, state, rest)


@pytest.mark.parametrize("tied", [True, False])
def test_decode_from_bits_equals_float32_decode_on_rounded_weights(monkeypatch, tied):
    # A chunk that does not divide the vocabulary: several scanned chunks and a static tail.
    monkeypatch.setattr(decoder, "HEAD_CHUNK", 16)
    model = _model(0, tied=tied)
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    bits = jax.tree.map(bf16_bits.to_bits, state)
    assert {leaf.dtype for leaf in jax.tree.leaves(bits)} == {np.dtype(np.uint16)}
    tokens = jnp.asarray([[3, 17, 42, 5], [7, 8, 9, 98]], jnp.int32)
    positions = jnp.asarray([[0, 1, 2, 3], [0, 1, 2, -1]], jnp.int32)

    @jax.jit
    def step(params):
        cache = KVCache.create(model.cfg, slots=2, max_len=8)
        return nnx.merge(graphdef, params, rest).decode(tokens, positions, cache)[0]

    want = np.asarray(step(nnx.state(_rounded(model), nnx.Param)))
    got = np.asarray(step(bits))
    real = np.asarray(positions) >= 0
    assert_reordered_close(got[real], want[real], model.cfg, length=8)
    assert np.ptp(want[real]) > 1.0


def _generate(engine: Engine, prompt: list[int], max_tokens: int) -> list[TokenEvent]:
    events: list[TokenEvent] = []
    done = threading.Event()

    def sink(batch: list[TokenEvent]) -> None:
        events.extend(batch)
        if events[-1].finish_reason:
            done.set()

    engine.submit(prompt, SamplingParams(temperature=0.0), max_tokens, sink)
    assert done.wait(120), "request did not finish"
    return events


def _full_forward_logprobs(
    model: Decoder, ids: list[int], prompt_len: int
) -> tuple[np.ndarray, float]:
    tokens = jnp.asarray([ids], jnp.int32)
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    logits = np.asarray(jax.jit(lambda m: m(tokens, positions))(model)[0], np.float64)
    top = logits.max(-1, keepdims=True)
    logprobs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    rows = np.arange(prompt_len - 1, len(ids) - 1)
    return logprobs[rows, np.asarray(ids[prompt_len:])], float(np.abs(logits).max())


def test_bf16_engine_serves_the_rounded_model_before_and_after_a_swap():
    first, second = _model(0, tied=True), _model(1, tied=True)
    engine = Engine(first, [EOS], CONFIG)
    engine.warm_up()
    engine.start()
    try:
        prompt = [4, 8, 15, 16, 23, 42]
        for served in (first, second):
            if served is second:
                engine.swap_params(nnx.state(second, nnx.Param), version=1)
                leaves = jax.tree.leaves(engine.steps.state)
                assert {leaf.dtype for leaf in leaves} == {np.dtype(np.uint16)}
            events = _generate(engine, prompt, 12)
            tokens = [e.token for e in events]
            want, scale = _full_forward_logprobs(_rounded(served), prompt + tokens, len(prompt))
            tol = logprob_reorder_tolerance(served.cfg, scale, len(prompt) + len(tokens))
            got = np.asarray([e.logprob for e in events])
            assert np.max(np.abs(got - want)) <= tol, got - want
            assert events[-1].version == (served is second)
    finally:
        engine.stop()


def test_weight_dtype_is_checked():
    with pytest.raises(
        ValueError, match="weight_dtype must be 'float32' or 'bfloat16', got 'float16'"
    ):
        ServeConfig(weight_dtype="float16")
    qwen = nnx.eval_shape(lambda: Qwen35Decoder(Qwen35Config.tiny(), rngs=nnx.Rngs(0)))
    with pytest.raises(
        ValueError, match=re.escape("serve the Qwen3.5 family with weight_dtype='float32'")
    ):
        Engine(qwen, [0], CONFIG)
