"""The model's compute dtype is what its matrix products multiply, on every backend.

Read from the lowered programs (the same StableHLO on CPU, GPU and TPU): every product of a
float32 model states HIGHEST, so no backend may round its operands to TF32 or to one bfloat16
pass; a bfloat16 model multiplies bfloat16 operands. Training forward and gradient, KV-cache
decode and packed prefill, for both families.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hlo_dots import assert_all_highest, dots

from harnessrl.model.cache import KVCache
from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.families.dense.decoder import Decoder
from harnessrl.model.families.qwen3_5 import Qwen35Config, Qwen35Decoder
from harnessrl.model.families.qwen3_5.cache import HybridCache

ROWS, LEN = 2, 8


def _inputs() -> tuple[jax.Array, jax.Array, jax.Array]:
    tokens_bt = jnp.zeros((ROWS, LEN), jnp.int32)
    positions_bt = jnp.tile(jnp.arange(LEN, dtype=jnp.int32), (ROWS, 1))
    segments_bt = jnp.asarray([[1] * 5 + [2] * 3, [1] * 6 + [0] * 2], jnp.int32)
    return tokens_bt, positions_bt, segments_bt


def _training(model: nnx.Module) -> list[jax.stages.Lowered]:
    """The forward the learner runs, and its gradient, as lowered programs."""
    graphdef, state = nnx.split(model)
    tokens_bt, positions_bt, segments_bt = _inputs()

    def loss(s: nnx.State) -> jax.Array:
        logits_btv = nnx.merge(graphdef, s)(tokens_bt, positions_bt, segments_bt)
        return jnp.mean(jax.nn.log_softmax(logits_btv, axis=-1)[..., 0])

    return [jax.jit(loss).lower(state), jax.jit(jax.grad(loss)).lower(state)]


def _serving(model: nnx.Module, cache: KVCache | HybridCache) -> list[jax.stages.Lowered]:
    """A prompt chunk into one slot and a decode step over every slot, as lowered programs."""
    graphdef, state = nnx.split(model)
    tokens_bt, positions_bt, _ = _inputs()

    def chunk(s: nnx.State, c: object) -> object:
        return nnx.merge(graphdef, s).decode(
            tokens_bt[:1], positions_bt[:1], c, slot=jnp.int32(1), last=jnp.int32(LEN - 1)
        )

    def step(s: nnx.State, c: object) -> object:
        return nnx.merge(graphdef, s).decode(tokens_bt[:, :1], positions_bt[:, 3:4], c, length=8)

    return [jax.jit(chunk).lower(state, cache), jax.jit(step).lower(state, cache)]


def _packed(model: Decoder, cache: KVCache) -> jax.stages.Lowered:
    graphdef, state = nnx.split(model)
    tokens_bt, positions_bt, segments_bt = _inputs()

    def packed(s: nnx.State, c: KVCache) -> object:
        return nnx.merge(graphdef, s).prefill_packed(
            tokens_bt[:1],
            positions_bt[:1],
            segments_bt[:1],
            jnp.asarray([[0] * 5 + [1] * 3], jnp.int32),
            c,
            last_n=jnp.asarray([4, 7], jnp.int32),
            held_n=jnp.zeros(2, jnp.int32),
            window=4,
        )

    return jax.jit(packed).lower(state, cache)


def _dense(compute_dtype: str, **kw: object) -> tuple[Decoder, KVCache]:
    model = Decoder(ModelConfig.tiny(compute_dtype=compute_dtype, **kw), rngs=nnx.Rngs(0))
    return model, KVCache.create(model.cfg, slots=ROWS, max_len=16)


@pytest.mark.parametrize("tied", [False, True])
def test_float32_decoder_states_highest_on_every_product(tied: bool) -> None:
    model, cache = _dense("float32", tie_word_embeddings=tied)
    for lowered in [*_training(model), *_serving(model, cache), _packed(model, cache)]:
        found = dots(lowered)
        assert_all_highest(found)
        assert {d.operands for d in found} == {("f32", "f32")}, {d.operands for d in found}


def test_float32_qwen3_5_states_highest_on_every_product() -> None:
    model = Qwen35Decoder(Qwen35Config.tiny(), rngs=nnx.Rngs(0))
    cache = HybridCache.create(model.cfg, slots=ROWS, max_len=16)
    for lowered in [*_training(model), *_serving(model, cache)]:
        found = dots(lowered)
        assert_all_highest(found)
        assert {d.operands for d in found} == {("f32", "f32")}, {d.operands for d in found}


@pytest.mark.parametrize("tied", [False, True])
def test_bfloat16_decoder_multiplies_bfloat16_operands(tied: bool) -> None:
    model, cache = _dense("bfloat16", tie_word_embeddings=tied)
    vocab = model.cfg.vocab_size
    forward, gradient = _training(model)
    for lowered in [forward, *_serving(model, cache), _packed(model, cache)]:
        found = dots(lowered)
        assert_all_highest(found)
        assert {d.operands for d in found} == {("bf16", "bf16")}, {d.operands for d in found}
    # The backward pass too, except the head's: the logits are float32 (so is the loss's
    # gradient of them), and the head's two gradient products multiply that gradient as it is.
    found = dots(gradient)
    assert_all_highest(found)
    wide = [d for d in found if "f32" in d.operands]
    assert len(wide) == 2 and all(vocab in d.shapes[0] + d.shapes[1] for d in wide), wide
    assert all(d.operands == ("bf16", "bf16") for d in found if d not in wide)


def test_bfloat16_qwen3_5_projects_in_bfloat16_and_runs_the_delta_rule_in_float32() -> None:
    model = Qwen35Decoder(Qwen35Config.tiny(compute_dtype="bfloat16"), rngs=nnx.Rngs(0))
    cfg = model.cfg
    found = dots(_training(model)[0])
    assert_all_highest(found)
    # The projections from the residual stream (its hidden size leading a weight) are bfloat16.
    projections = [d for d in found if d.shapes[1][:1] == (cfg.hidden_size,)]
    assert len(projections) >= cfg.num_layers and all(
        d.operands == ("bf16", "bf16") for d in projections
    ), projections
    # The delta rule's products (batched over rows and value heads) are float32 by design.
    heads = cfg.linear_num_value_heads
    rule = [d for d in found if d.shapes[0][:2] == (ROWS, heads) and len(d.shapes[0]) >= 4]
    assert rule and all(d.operands == ("f32", "f32") for d in rule), rule


def test_products_state_their_precision_under_any_process_default() -> None:
    """A process-wide default (`jax_default_matmul_precision`, or its environment variable)
    does not reach the model: its products keep their own precision, so a learner and a server
    started with different defaults still compute the same float32 numbers."""
    model, cache = _dense("float32")
    with jax.default_matmul_precision("bfloat16"):
        found = dots(_serving(model, cache)[1])
    assert_all_highest(found)
    # And the forward's numbers are the same under either default (CPU: float32 either way,
    # which is what every backend now computes).
    tokens_bt, positions_bt, segments_bt = _inputs()
    forward = nnx.jit(lambda m: m(tokens_bt, positions_bt, segments_bt))
    with jax.default_matmul_precision("bfloat16"):
        low = np.asarray(forward(model))
    np.testing.assert_array_equal(low, np.asarray(forward(model)))
