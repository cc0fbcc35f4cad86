"""The Qwen3.5 hybrid decoder against transformers' `Qwen3_5ForCausalLM` on tiny random configs.

Bounds follow `reference_bounds`: the reference also runs in float64, and our float32 error may
be a small multiple of the reference's own. transformers' delta-rule fallback casts to float32
even in a float64 model, so its float64 run gets a float64 recurrence written from the rule's
equations (an independent statement of the math); everything else is transformers' code.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from reference_bounds import (
    GRADIENT_ERROR_RATIO,
    assert_logits_match_reference,
    assert_reordered_close,
    reference_bounds,
    reorder_tolerance,
)
from torch_reference import torch_causal_lm

from harnessrl.model.families.qwen3_5 import Qwen35Config, Qwen35Decoder
from harnessrl.model.families.qwen3_5 import gated_deltanet as gdn
from harnessrl.model.families.qwen3_5.hf import hf_from_params, params_from_hf, read_hf_folder
from harnessrl.model.formats.export import export_hf, params_numpy
from harnessrl.model.sharding import LOGICAL_AXES

CONFIGS: dict[str, dict[str, Any]] = {
    # [DeltaNet, attention] x 2, 2 value heads per key head, 5 chunks of 8 over 40 tokens.
    "hybrid": {},
    # Three DeltaNet layers then attention, tied embeddings, equal heads, a half-rotary head.
    "interval4_tied": {
        "full_attention_interval": 4,
        "tie_word_embeddings": True,
        "linear_num_key_heads": 4,
        "partial_rotary_factor": 0.5,
        "chunk_size": 16,
    },
}
LENGTH = 40


def random_model(name: str = "hybrid", seed: int = 0) -> Qwen35Decoder:
    model = Qwen35Decoder(Qwen35Config.tiny(**CONFIGS[name]), rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(7 + seed)
    noisy = jax.tree.map(
        lambda x: x + 0.2 * rng.standard_normal(x.shape).astype(x.dtype),
        nnx.state(model, nnx.Param),
    )
    nnx.update(model, noisy)
    return model


def _float64_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q, per token, in the inputs' dtype."""
    assert use_qk_l2norm_in_kernel and initial_state is None
    group = value.shape[2] // key.shape[2]
    q, k = (x.repeat_interleave(group, dim=2) for x in (query, key))
    q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q / q.shape[-1] ** 0.5
    b, t, h, dk = k.shape
    s = torch.zeros(b, h, dk, value.shape[-1], dtype=value.dtype)
    out = []
    for i in range(t):
        s = s * g[:, i].exp()[..., None, None]
        delta = (value[:, i] - torch.einsum("bhkv,bhk->bhv", s, k[:, i])) * beta[:, i, :, None]
        s = s + torch.einsum("bhk,bhv->bhkv", k[:, i], delta)
        out.append(torch.einsum("bhkv,bhk->bhv", s, q[:, i]))
    return torch.stack(out, dim=1), (s if output_final_state else None)


@pytest.fixture
def float64_delta_rule(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The float64 reference runs the delta rule per token in float64 (transformers' chunked
    fallback computes in float32 whatever its inputs); the float32 reference keeps transformers'
    own chunked rule, so its error, the tests' yardstick, is that of a chunked float32 delta rule
    as ours is."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    chunked = modeling_qwen3_5.torch_chunk_gated_delta_rule

    def delta_rule(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        value = kwargs["value"] if "value" in kwargs else args[2]
        rule = _float64_delta_rule if value.dtype == torch.float64 else chunked
        return rule(*args, **kwargs)

    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule", delta_rule)
    yield


def references(model: Qwen35Decoder) -> tuple[Any, Any]:
    """transformers' model holding our weights, in float32 and (a copy) in float64."""
    cfg = model.cfg
    tensors = hf_from_params(cfg, params_numpy(model))
    ref32 = torch_causal_lm(cfg.to_hf_config(), tensors)
    assert type(ref32).__name__ == "Qwen3_5ForCausalLM"
    return ref32, torch_causal_lm(cfg.to_hf_config(), tensors).double()


def _ids(cfg: Qwen35Config, n: int = LENGTH, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, n).tolist()


@nnx.jit
def _forward(
    m: Qwen35Decoder, tokens: jax.Array, positions: jax.Array, seg: jax.Array
) -> jax.Array:
    return m(tokens, positions, seg)


def _logits(
    model: Qwen35Decoder, tokens: np.ndarray, positions: np.ndarray, seg: np.ndarray | None = None
) -> np.ndarray:
    """One compiled forward per shape: rows of LENGTH tokens, segment ids default to one segment."""
    seg = np.ones_like(tokens) if seg is None else seg
    return np.asarray(
        _forward(model, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(seg))
    )


def _token_logprobs(logits: np.ndarray, ids: list[int]) -> np.ndarray:
    """Log-probability of each next token, in float64 from the given logits."""
    lp = torch.log_softmax(torch.from_numpy(np.asarray(logits, np.float64)), -1)[0, :-1]
    return lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_logprobs_match_transformers(name: str, float64_delta_rule: None) -> None:
    model = random_model(name)
    ref32, ref64 = references(model)
    ids = _ids(model.cfg)
    with torch.no_grad():
        want = ref32(torch.tensor([ids])).logits.numpy()
        exact = ref64(torch.tensor([ids])).logits.numpy()
    ours = _logits(model, np.asarray([ids], np.int32), np.arange(LENGTH, dtype=np.int32)[None])
    measured = assert_logits_match_reference(ours, want, exact, name)
    assert measured["ours_vs_float64"] > 0  # a real float32 computation, not the reference's
    # Per-token logprobs: ours from our float32 log_softmax, the reference's from its own.
    ours_lp = np.asarray(jax.nn.log_softmax(jnp.asarray(ours), -1))[0, :-1]
    ours_lp = ours_lp[np.arange(LENGTH - 1), ids[1:]]
    ref32_lp = torch.log_softmax(torch.from_numpy(want), -1)[0, :-1].numpy()
    ref32_lp = ref32_lp[np.arange(LENGTH - 1), ids[1:]]
    exact_lp = _token_logprobs(exact, ids)
    _, vs_exact, vs_ref = reference_bounds(ref32_lp, exact_lp)
    assert np.abs(ours_lp - exact_lp).max() <= vs_exact
    assert np.abs(ours_lp - ref32_lp).max() <= vs_ref


def test_gradients_match_transformers(float64_delta_rule: None) -> None:
    model = random_model("hybrid")
    cfg = model.cfg
    ref32, ref64 = references(model)
    ids = _ids(cfg)
    tokens = jnp.asarray([ids], jnp.int32)
    positions = jnp.arange(LENGTH, dtype=jnp.int32)[None]
    targets = jnp.asarray(ids[1:])

    def loss(m: Qwen35Decoder) -> jax.Array:  # mean next-token NLL, the learner's log-likelihood
        lp = jax.nn.log_softmax(m(tokens, positions)[0, :-1], -1)
        return -jnp.mean(lp[jnp.arange(LENGTH - 1), targets])

    grads = nnx.jit(nnx.grad(loss))(model)
    ours = hf_from_params(cfg, jax.tree.map(np.asarray, nnx.to_pure_dict(grads)))
    want: dict[str, dict[str, np.ndarray]] = {}
    for label, ref in (("32", ref32), ("64", ref64)):
        ref.zero_grad()
        out = ref(torch.tensor([ids]), labels=torch.tensor([ids]))
        out.loss.backward()
        want[label] = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    assert set(ours) == set(want["64"])
    worst = 0.0
    for name in sorted(ours):
        ref_error, vs_exact, vs_ref = reference_bounds(
            want["32"][name], want["64"][name], GRADIENT_ERROR_RATIO
        )
        err = float(np.abs(ours[name] - want["64"][name]).max())
        assert err <= vs_exact, (name, err, vs_exact, ref_error)
        assert float(np.abs(ours[name] - want["32"][name]).max()) <= vs_ref, name
        worst = max(worst, err / vs_exact)
    assert worst > 0


def test_packed_rows_equal_each_sequence_alone() -> None:
    """Segments of 13 and 19 tokens (boundaries inside chunks and conv windows), then padding."""
    model = random_model("hybrid")
    cfg = model.cfg
    lengths = (13, 19)
    seqs = [_ids(cfg, n, seed=10 + i) for i, n in enumerate(lengths)]

    def row(parts: list[tuple[list[int], int]]) -> tuple[np.ndarray, ...]:
        tokens, positions, segments = (np.zeros((1, LENGTH), np.int32) for _ in range(3))
        start = 0
        for seq, segment in parts:
            tokens[0, start : start + len(seq)] = seq
            positions[0, start : start + len(seq)] = np.arange(len(seq))
            segments[0, start : start + len(seq)] = segment
            start += len(seq)
        return tokens, positions, segments

    packed = _logits(model, *row([(seqs[0], 1), (seqs[1], 2)]))
    start = 0
    alone = []
    for seq in seqs:  # the sequence at the start of its own row, padding after it
        alone.append(_logits(model, *row([(seq, 1)]))[:, : len(seq)])
        assert_reordered_close(packed[:, start : start + len(seq)], alone[-1], cfg, LENGTH)
        start += len(seq)
    # Without the reset the second sequence reads the first one's state: far outside the bound.
    leaky = _logits(model, *row([(seqs[0], 1), (seqs[1], 1)]))
    second = slice(lengths[0], sum(lengths))
    tol = reorder_tolerance(cfg, float(np.abs(alone[1]).max()), LENGTH)
    assert np.abs(leaky[:, second] - alone[1]).max() > 100 * tol


# Jitted: op-by-op dispatch of the chunked rule compiles every primitive and took seconds.
CHUNKED = jax.jit(gdn.chunked_gated_delta_rule, static_argnums=6)
RECURRENT = jax.jit(gdn.recurrent_gated_delta_rule)


@pytest.mark.parametrize("chunk", [4, 8, 64])
def test_chunked_delta_rule_equals_the_recurrence(chunk: int) -> None:
    rng = np.random.default_rng(3)
    b, t, h, dk, dv = 2, 21, 3, 8, 5
    q, k = (gdn.l2_normalize(jnp.asarray(rng.standard_normal((b, t, h, dk)))) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, t, h, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 2.0, (b, t, h)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (b, t, h)), jnp.float32)
    segments = np.ones((b, t), np.int32)
    segments[1, 6:] = 2  # row 1: a boundary at 6 and at 15
    segments[1, 15:] = 3
    run = gdn.run_ids(jnp.asarray(segments))
    keep = jnp.concatenate([jnp.zeros((b, 1)), (run[:, 1:] == run[:, :-1]).astype(jnp.float32)], 1)
    got, _ = CHUNKED(q, k, v, g, beta, run, chunk)
    want, _ = RECURRENT(q, k, v, g, beta, jnp.zeros((b, h, dk, dv)), keep)
    # Both are float32 sums of t terms of the state's scale, ordered differently.
    tol = 4 * np.sqrt(t * dk) * np.finfo(np.float32).eps * float(np.abs(want).max())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, rtol=0)


@pytest.mark.parametrize("chunk", [4, 64])
def test_chunked_delta_rule_continues_a_state_as_the_server_prefills(chunk: int) -> None:
    """Two prompt chunks of one row, the second padded (g = beta = 0), the state carried between
    them: outputs and final state equal the recurrence over the real tokens at once."""
    rng = np.random.default_rng(4)
    b, t, h, dk, dv, split, real = 2, 19, 2, 8, 5, 7, 16
    q, k = (gdn.l2_normalize(jnp.asarray(rng.standard_normal((b, t, h, dk)))) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, t, h, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 2.0, (b, t, h)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (b, t, h)), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((b, h, dk, dv)), jnp.float32)  # a slot's earlier tokens
    want, want_state = RECURRENT(
        q[:, :real], k[:, :real], v[:, :real], g[:, :real], beta[:, :real], s0, jnp.ones((b, real))
    )
    padded = (jnp.arange(t) < real)[None, :, None]
    g, beta = jnp.where(padded, g, 0.0), jnp.where(padded, beta, 0.0)
    one_run = jnp.zeros((b, t), jnp.int32)
    first, state = CHUNKED(*(x[:, :split] for x in (q, k, v, g, beta, one_run)), chunk, s0)
    second, state = CHUNKED(*(x[:, split:] for x in (q, k, v, g, beta, one_run)), chunk, state)
    got = jnp.concatenate([first, second], axis=1)[:, :real]
    scale = max(float(np.abs(want).max()), float(np.abs(want_state).max()))
    tol = 4 * np.sqrt(t * dk) * np.finfo(np.float32).eps * scale
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, rtol=0)
    np.testing.assert_allclose(np.asarray(state), np.asarray(want_state), atol=tol, rtol=0)


def test_export_loads_in_transformers_and_reimports(tmp_path: Path) -> None:
    import transformers

    model = random_model("interval4_tied")
    folder = export_hf(model, tmp_path / "export")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    ids = _ids(model.cfg)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.numpy()
    ref32, _ = references(model)
    with torch.no_grad():
        direct = ref32(torch.tensor([ids])).logits.numpy()
    np.testing.assert_array_equal(theirs, direct)  # the same weights, bit for bit
    cfg, tensors = read_hf_folder(folder)
    # The chunk size is ours to choose (a static shape), not part of the checkpoint.
    assert cfg.chunk_size == Qwen35Config.chunk_size
    assert cfg.replace(chunk_size=model.cfg.chunk_size) == model.cfg
    back = params_from_hf(cfg, tensors)
    for a, b in zip(jax.tree.leaves(params_numpy(model)), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)


def test_import_reads_the_multimodal_checkpoints_text_model(tmp_path: Path) -> None:
    """A `qwen3_5` folder: text config nested, `model.language_model.*`, vision and MTP skipped."""
    from safetensors.numpy import save_file

    model = random_model("hybrid")
    cfg = model.cfg
    tensors = hf_from_params(cfg, params_numpy(model))
    renamed = {
        (k if k == "lm_head.weight" else "model.language_model." + k[len("model.") :]): v
        for k, v in tensors.items()
    }
    renamed["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    renamed["model.visual.patch_embed.proj.weight"] = np.zeros((2, 2), np.float32)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    config = {"model_type": "qwen3_5", "text_config": cfg.to_hf_config(), "vision_config": {}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    got_cfg, got = read_hf_folder(tmp_path)
    assert got_cfg.replace(chunk_size=cfg.chunk_size) == cfg and not any(
        k.startswith(("mtp.", "model.visual.")) for k in got
    )
    back = params_from_hf(got_cfg, got)
    for a, b in zip(jax.tree.leaves(params_numpy(model)), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)


def test_config_round_trip_and_errors() -> None:
    cfg = Qwen35Config.tiny()
    assert Qwen35Config.from_hf_config(cfg.to_hf_config(), chunk_size=cfg.chunk_size) == cfg
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2
    bad = {**cfg.to_hf_config(), "layer_types": ["full_attention", "linear_attention"] * 2}
    with pytest.raises(ValueError, match="layer_types"):
        Qwen35Config.from_hf_config(bad)
    with pytest.raises(ValueError, match="multiple of full_attention_interval"):
        Qwen35Config.tiny(num_layers=3)
    with pytest.raises(ValueError, match="chunk_size"):
        Qwen35Config.tiny(chunk_size=0)
    with pytest.raises(ValueError, match="model_type"):
        Qwen35Config.from_hf_config({"model_type": "llama"})


def test_every_parameter_has_logical_axes() -> None:
    model = Qwen35Decoder(Qwen35Config.tiny(), rngs=nnx.Rngs(0))
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        axes = var.get_metadata()["out_sharding"]
        assert len(axes) == var[...].ndim, path
        assert set(axes) - {None} <= set(LOGICAL_AXES), path


def test_decode_through_the_cache_equals_the_full_forward() -> None:
    """Prefill slot 1 in two chunks (the second padded), decode one token a call beside an idle
    slot 0, then reuse slot 1 for a new sequence: every logit equals the full forward's."""
    from harnessrl.model.families.qwen3_5.cache import HybridCache

    model = random_model("hybrid")
    cfg = model.cfg
    steps = nnx.jit(lambda m, t, p, c: m.decode(t, p, c, length=32))
    one_slot = nnx.jit(lambda m, t, p, c, s: m.decode(t, p, c, slot=s, length=32))
    seq = _ids(cfg, 17, seed=5)
    full = _logits(model, np.asarray([seq + [0] * (LENGTH - 17)]), np.arange(LENGTH)[None])[0]
    scale = float(np.abs(full[:17]).max())
    cache = HybridCache.create(cfg, slots=2, max_len=32)
    got = []
    for start, end in ((0, 6), (6, 11)):  # chunks of 6: the second carries one pad
        tokens, positions = np.zeros((1, 6), np.int32), np.full((1, 6), -1, np.int32)
        tokens[0, : end - start], positions[0, : end - start] = seq[start:end], range(start, end)
        logits, cache = one_slot(model, jnp.asarray(tokens), jnp.asarray(positions), cache, 1)
        got.append(np.asarray(logits)[0, : end - start])
    for p in range(11, 17):
        tokens = jnp.asarray([[0], [seq[p]]], jnp.int32)
        logits, cache = steps(model, tokens, jnp.asarray([[-1], [p]], jnp.int32), cache)
        got.append(np.asarray(logits)[1])
    assert_reordered_close(np.concatenate(got), full[:17], cfg, LENGTH, scale)
    # Slot 1 again from position 0 (its state dropped), and slot 0's first sequence.
    other = _ids(cfg, 5, seed=6)
    alone = _logits(model, np.asarray([other + [0] * (LENGTH - 5)]), np.arange(LENGTH)[None])
    for slot, ids, want in ((1, seq[:5], full[:5]), (0, other, alone[0, :5])):
        tokens = jnp.asarray([[*ids, 0]], jnp.int32)
        positions = jnp.asarray([[*range(5), -1]], jnp.int32)
        logits, cache = one_slot(model, tokens, positions, cache, slot)
        assert_reordered_close(np.asarray(logits)[0, :5], want, cfg, LENGTH, scale)


def test_load_model_and_policy_specs_build_the_family(tmp_path: Path) -> None:
    from harnessrl.model.formats.load import load_model, load_policy

    model = random_model("hybrid")
    loaded = load_model(export_hf(model, tmp_path / "export"))
    assert isinstance(loaded.model, Qwen35Decoder)
    for a, b in zip(
        jax.tree.leaves(params_numpy(model)),
        jax.tree.leaves(params_numpy(loaded.model)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    policy, tokenizer = load_policy("tiny-qwen3_5")
    assert isinstance(policy, Qwen35Decoder)
    assert policy.cfg.vocab_size == tokenizer.vocab_size and policy.cfg.tie_word_embeddings
