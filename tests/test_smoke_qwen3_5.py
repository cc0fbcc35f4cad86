"""`--smoke serve.model=smollm2-qwen3_5`: a SmolLM2-sized Qwen3.5 hybrid (28 layers: 21 Gated
DeltaNet, 7 gated attention) serves the harness runs and takes one GRPO step on the 2-device
sharded learner, through the whole loop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FINAL = re.compile(r"^train: eval_reward_start=\S+ eval_reward_end=\S+ .*steps=(\d+) minutes=\S+$")


@pytest.mark.skipif(
    os.environ.get("HARNESSRL_SLOW") != "1",
    reason="compiles a 28-layer hybrid for serving and training (minutes): set HARNESSRL_SLOW=1",
)
def test_smollm2_sized_qwen3_5_takes_one_grpo_step(tmp_path: Path) -> None:
    out = tmp_path / "smoke"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    argv = [sys.executable, "-m", "harnessrl.train", "--smoke", "serve.model=smollm2-qwen3_5",
            "run.steps=1", f"run.out_dir={out}", "run.export_hf=false"]  # fmt: skip
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # an orderly stop: no sidecar or harness left behind
        stdout, stderr = proc.communicate(timeout=120)
        pytest.fail(f"smoke run exceeded 1800 s; output ends:\n{stdout[-2000:]}{stderr[-2000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    m = FINAL.match(stdout.strip().splitlines()[-1])
    assert m and int(m[1]) == 1, stdout[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (step,) = [r for r in records if r["kind"] == "train"]
    assert step["runs"] == 4 and step["runs_failed"] == 0
    assert step["learner_step"] == 1 and step["micro_batches"] >= 1  # the sharded update ran
    assert step["t_swap"] > 0  # and its weights reached the server
    assert json.loads((out / "config.json").read_text())["serve"]["model"] == "smollm2-qwen3_5"
