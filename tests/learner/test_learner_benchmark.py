"""The learner benchmark's code path on a tiny model: its final line, and a torch baseline that
computes the same logprobs and the same loss gradient as our learner on the same packed batch."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flax import nnx
from tinylearn import GRADIENT_PROBE, policy_logprobs, step_gradient

from harnessrl.benchmarks import learner as bench
from harnessrl.benchmarks.model import torch_reference
from harnessrl.data.pack import PackedBatch
from harnessrl.learner.config import LearnerConfig
from harnessrl.learner.step import Learner
from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.families.dense.decoder import Decoder
from harnessrl.model.families.dense.hf import hf_from_params
from harnessrl.model.formats.export import export_hf

REPO = Path(__file__).resolve().parents[2]
FINAL = re.compile(
    r"learner: tokens_per_s=(?P<tps>\S+) vs_torch=(?P<vs>\S+) "
    r"matmul_probe_fraction=(?P<frac>\S+) dtype=(?P<dtype>float32|bfloat16) "
    r"compiles=(?P<compiles>\d+)"
)
# Two float32 implementations of the same math differ from a float64 run by a few ulps each,
# summed in different orders; 8x the reference's own float32 error (floored at one ulp of the
# values' scale) leaves room for that and stays far below what a wrong mask or loss term gives.
ERROR_FACTOR = 8.0
FLOAT32_EPS = float(np.finfo(np.float32).eps)


def tiny_decoder() -> Decoder:
    return Decoder(ModelConfig.tiny(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_hf(tiny_decoder(), tmp_path_factory.mktemp("tiny") / "model")


def near_policy_batch(model: Decoder, seed: int) -> dict[str, np.ndarray]:
    """A packed batch whose behavior logprobs put the ratios around 1, some of them clipped.

    The benchmark's constant behavior logprob leaves a tiny random model's ratios far below the
    clip range, where half the rows have no gradient; timing does not care, a gradient check does.
    """
    batch = bench.packed_batch(2, 64, model.cfg.vocab_size, seed=seed)
    with torch.no_grad():
        logp = bench.torch_logprobs(torch_reference(model), batch)[0].numpy()
    noise = np.random.default_rng(seed).normal(0.0, 0.2, logp.shape)
    return {**batch, "behavior_logprobs": (logp + noise).astype(np.float32)}


def bound(reference32: np.ndarray, reference64: np.ndarray) -> float:
    own_error = float(np.max(np.abs(reference32 - reference64)))
    ulp = FLOAT32_EPS * float(np.max(np.abs(reference64)))
    return ERROR_FACTOR * max(own_error, ulp)


def test_cli_final_line_reports_vs_torch(tiny_folder: Path, xla_cache_env: dict[str, str]) -> None:
    """Each variant is set against PyTorch in its own compute dtype, and the last line names the
    dtype of the variant it reports."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **xla_cache_env}
    cmd = [sys.executable, "-m", "harnessrl.benchmarks.learner", "--model", str(tiny_folder)]
    cmd += ["--rows", "2", "--length", "64", "--steps", "2", "--variants", "fp32,bf16"]
    proc = subprocess.run(
        [*cmd, "--peak-size", "128"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    match = FINAL.fullmatch(lines[-1])
    assert match, f"final line has the wrong format: {lines[-1]!r}"
    for key in ("tps", "vs", "frac"):
        value = float(match[key])
        assert math.isfinite(value) and value > 0, f"{key}={match[key]}"
    assert int(match["compiles"]) == 2  # one micro-step shape plus the apply
    threads = len(os.sched_getaffinity(0))
    baselines = [line for line in lines if line.startswith("torch baseline")]
    assert len(baselines) == 2 and all(f"{threads} threads" in b for b in baselines), proc.stdout
    assert "(float32)" in baselines[0] and "(bfloat16)" in baselines[1]
    assert "bf16 autocast" in baselines[1] and "autocast" not in baselines[0]
    rows = {
        v: next(ln for ln in lines if ln.lstrip().startswith(f"{v}:")) for v in ("fp32", "bf16")
    }
    assert "torch (float32)" in rows["fp32"] and "torch (bfloat16)" in rows["bf16"], rows
    best = next(line for line in lines if line.startswith("best: ")).split()[1]
    assert match["dtype"] == bench.VARIANTS[best]["compute_dtype"]
    assert f"vs_torch={match['vs']}" in rows[best]


def test_torch_logprobs_match_the_learner_on_packed_rows() -> None:
    model = tiny_decoder()
    batch = bench.packed_batch(2, 64, model.cfg.vocab_size)
    ours = policy_logprobs(Learner(model, LearnerConfig()), PackedBatch(**batch))
    reference = torch_reference(model)
    with torch.no_grad():
        torch32 = bench.torch_logprobs(reference, batch)[0].numpy()
        torch64 = bench.torch_logprobs(reference.double(), batch)[0].numpy()
        unpacked = {**batch, "segment_ids": np.ones_like(batch["segment_ids"])}
        causal_only = bench.torch_logprobs(reference, unpacked)[0].numpy()
    trained = batch["loss_mask"] > 0
    limit = bound(torch32[trained], torch64[trained])
    assert np.max(np.abs(ours - torch64)[trained]) <= limit
    # The segment mask is what makes the rows packed: without it torch scores other tokens.
    assert np.max(np.abs(ours - causal_only)[trained]) > 100 * limit


def test_torch_loss_gradient_matches_the_learner() -> None:
    model, cfg = tiny_decoder(), GRADIENT_PROBE
    batch = near_policy_batch(model, seed=3)
    learner = Learner(model, cfg)
    _, grads = step_gradient(learner, [PackedBatch(**batch)])
    ours = hf_from_params(model.cfg, nnx.to_pure_dict(learner.parts.params_state(grads)))
    by_precision = {}
    for dtype in (torch.float32, torch.float64):
        reference = torch_reference(model).to(dtype)
        bench.torch_loss(reference, batch, cfg).backward()
        by_precision[dtype] = {
            name: p.grad.double().numpy() for name, p in reference.named_parameters()
        }
    assert set(ours) == set(by_precision[torch.float64])
    for name, ours_grad in ours.items():
        g32, g64 = by_precision[torch.float32][name], by_precision[torch.float64][name]
        assert np.max(np.abs(g64)) > 0, f"{name}: no gradient, the comparison would be empty"
        limit = bound(g32, g64)
        assert np.max(np.abs(np.asarray(ours_grad, np.float64) - g64)) <= limit, name


def test_torch_train_step_updates_like_adamw() -> None:
    """The baseline's optimizer step moves every weight by about the learning rate (AdamW's first
    step is lr * g / (|g| + eps)), so it is doing an update, not only a backward."""
    model = tiny_decoder()
    batch = near_policy_batch(model, seed=4)
    reference = torch_reference(model)
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    cfg = LearnerConfig(learning_rate=1e-3)
    bench.torch_train_step(reference, batch, cfg)()
    for name, p in reference.named_parameters():
        moved = (p.detach() - before[name]).abs().max().item()
        assert 0 < moved <= cfg.learning_rate * (1 + 1e-3), name


@pytest.mark.parametrize(
    ("dtype", "matmul"), [("float32", torch.float32), ("bfloat16", torch.bfloat16)]
)
def test_torch_train_step_computes_in_the_variants_dtype(dtype: str, matmul: torch.dtype) -> None:
    """A bf16 variant's baseline runs its matmuls in bf16 (autocast) over float32 weights, with
    float32 logprobs, as our bf16 step does; a float32 one stays float32 throughout."""
    model = tiny_decoder()
    batch = near_policy_batch(model, seed=5)
    reference = torch_reference(model)
    seen: dict[str, torch.dtype] = {}
    layer = reference.model.layers[0].mlp.down_proj
    layer.register_forward_hook(lambda _m, _i, out: seen.update(matmul=out.dtype))
    original = bench.torch_logprobs

    def logprobs(ref: object, b: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        logp, entropy = original(ref, b)
        seen.setdefault("logprobs", logp.dtype)
        return logp, entropy

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "torch_logprobs", logprobs)
        bench.torch_train_step(reference, batch, LearnerConfig(learning_rate=1e-3), dtype)()
    assert seen == {"matmul": matmul, "logprobs": torch.float32}
    assert {p.dtype for p in reference.parameters()} == {torch.float32}
    with pytest.raises(ValueError, match="got 'float16'"):
        bench.torch_train_step(reference, batch, LearnerConfig(), "float16")


def test_no_torch_drops_vs_torch(
    tiny_folder: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    argv = ["--model", str(tiny_folder), "--rows", "2", "--length", "64", "--steps", "1"]
    bench.main([*argv, "--variants", "fp32", "--peak-size", "64", "--no-torch"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"learner: tokens_per_s=\S+ matmul_probe_fraction=\S+ dtype=float32 compiles=2", last
    ), last


def test_missing_torch_names_the_fix(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args([])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[dev]'" in err and "--no-torch" in err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--length", "16"], "--length >= 40"),
        (["--rows", "0"], "--rows >= 1"),
        (["--variants", "fp64"], "unknown ['fp64']"),
        (["--variants", ","], "choose from"),
    ],
)
def test_bad_flags_are_refused(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args([*flags, "--no-torch"])
    assert named in capsys.readouterr().err
