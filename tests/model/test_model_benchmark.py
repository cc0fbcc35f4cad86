"""`python -m harnessrl.benchmarks.model --family qwen3_5` on a tiny shape: ours and transformers'
Qwen3.5 forward+backward on the same weights, ending with the benchmark's one-line summary."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from flax import nnx

from harnessrl.benchmarks.model import qwen35_flops_per_token
from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.families.dense.decoder import Decoder
from harnessrl.model.families.qwen3_5 import SHAPES as QWEN35_SHAPES
from harnessrl.model.families.qwen3_5 import Qwen35Config, Qwen35Decoder
from harnessrl.model.formats.export import export_hf

ROOT = Path(__file__).resolve().parents[2]
FINAL = re.compile(
    r"^model: tokens_per_s=(\d+\.\d) matmul_probe_fraction=(\d+\.\d{3}) vs_torch=(\d+\.\d\d)$"
)


def test_last_line_names_the_matmul_probe_fraction(
    tmp_path: Path, xla_cache_env: dict[str, str]
) -> None:
    """The figure is the step's model FLOP/s over a matmul probe's (which it can exceed), named
    so: it is not a fraction of the chip's peak."""
    folder = export_hf(Decoder(ModelConfig.tiny(), rngs=nnx.Rngs(0)), tmp_path / "tiny")
    argv = [sys.executable, "-m", "harnessrl.benchmarks.model", "--model", str(folder),
            "--rows", "1", "--length", "16", "--repeats", "1", "--peak-size", "64", "--no-torch"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **xla_cache_env}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    m = re.fullmatch(r"model: tokens_per_s=(\d+\.\d) matmul_probe_fraction=(\d+\.\d{3})", lines[-1])
    assert m, f"last line is {lines[-1]!r}"
    assert float(m[1]) > 0 and float(m[2]) > 0
    assert any(line.startswith("matmul probe float32: ") and "64^3" in line for line in lines)


def test_9b_shape_is_qwen35_9b_text_model() -> None:
    cfg = Qwen35Config(**QWEN35_SHAPES["qwen3_5-9b-shape"])
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (4096, 12288, 248320)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim) == (16, 4, 256, 64)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (16, 32)
    # At length 1 the FLOPs are 6 x the projection weights (the `w*` params and the LM head;
    # not the embedding lookup, norms or conv) plus the small per-token delta-rule term.
    abstract = nnx.eval_shape(lambda: Qwen35Decoder(cfg, rngs=nnx.Rngs(0)))
    flat = nnx.to_flat_state(nnx.state(abstract, nnx.Param))
    n_matmul = sum(v.size for path, v in flat if str(path[-1]).startswith(("w", "lm_head")))
    assert qwen35_flops_per_token(cfg, 1) == pytest.approx(6 * n_matmul, rel=0.02)


@pytest.mark.skipif(
    not os.environ.get("HARNESSRL_SLOW"),
    reason="imports torch and runs transformers' reference delta rule: set HARNESSRL_SLOW=1",
)
def test_qwen3_5_family_runs_against_transformers() -> None:
    argv = [sys.executable, "-m", "harnessrl.benchmarks.model", "--family", "qwen3_5",
            "--shape", "tiny-qwen3_5", "--vocab", "128", "--length", "32", "--repeats", "1"]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = FINAL.match(last)
    assert m, f"last line is {last!r}"
    assert float(m[1]) > 0 and float(m[3]) > 0
    assert "model: qwen3_5 4 layers d=32 vocab=128" in proc.stdout


def test_side_by_side_alternates_and_takes_the_median_ratio() -> None:
    """Rounds alternate ours and theirs, so a load change hits both; the ratio is per round."""
    from harnessrl.benchmarks import model as bench

    calls: list[str] = []
    clock = iter([0.0, 1.0, 1.0, 3.0, 3.0, 4.0, 4.0, 9.0, 9.0, 11.0, 11.0, 11.5])

    def ours() -> None:
        calls.append("ours")

    def theirs() -> None:
        calls.append("theirs")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench.time, "perf_counter", lambda: next(clock))
        best_ours, best_theirs, ratio = bench.side_by_side(ours, theirs, 3)
    assert calls == ["ours", "theirs"] * 4  # warm-up, then three alternating rounds
    # Rounds (ours, theirs): (1, 2), (1, 5), (2, 0.5) → ratios 2, 5, 0.25 → median 2.
    assert (best_ours, best_theirs, ratio) == (1.0, 0.5, 2.0)
