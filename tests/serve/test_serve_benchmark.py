"""`python -m harnessrl.benchmarks.serve` on a tiny random model: both weight precisions run,
nothing compiles after warm-up, and the last line carries every figure (vLLM's as `na` here)."""

from __future__ import annotations

import re
import subprocess
import sys


def test_serve_benchmark_runs_both_precisions_and_ends_with_its_line():
    command = [
        sys.executable, "-m", "harnessrl.benchmarks.serve", "--model", "tiny",
        "--max-tokens", "2", "--max-model-len", "256", "--requests-c1", "1", "--requests-c8", "8", "--rounds", "2",
    ]  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert "float32 weights" in done.stdout and "bfloat16 weights" in done.stdout
    assert "WARNING" not in done.stdout  # no program compiled after warm-up
    last = lines[-1]
    pattern = (
        r"serve: tokens_per_s_c8=[\d.]+ vllm_ratio=na tokens_per_s_c8_float32=[\d.]+ "
        r"vllm_ratio_float32=na tokens_per_s_c8_bfloat16=[\d.]+ vllm_ratio_bfloat16=na compiles=\d+"
    )
    assert re.fullmatch(pattern, last), last
    c8 = [line for line in lines if "c=8:" in line]
    assert len(c8) == 4 and all("8 requests, 16 tokens" in line for line in c8), c8  # 2 x 2 rounds
