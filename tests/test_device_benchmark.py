"""`python -m harnessrl.benchmarks.device` at its CPU size: a train step and engine decode on the
same tiny Qwen3 shapes, no recompiles after warm-up, the Qwen3.5 prefill comparison, and its
one-line summary."""

from __future__ import annotations

import re

import pytest

from harnessrl.benchmarks import device

FINAL = re.compile(
    r"^device: platform=(?P<platform>\S+) kind=(?P<kind>\S+) mfu=(?P<mfu>na|\d+\.\d+) "
    r"train_tokens_s=(?P<train>\d+\.\d) decode_tokens_s=(?P<decode>na|\d+\.\d) "
    r"compiles_train=(?P<ct>\d+) compiles_decode=(?P<cd>\d+) prefill_speedup=(?P<ps>\d+\.\d\d)$"
)


def test_cpu_run_reports_rates_and_compiles_once(capsys: pytest.CaptureFixture[str]) -> None:
    device.main(["--budget-s", "600"])
    out = capsys.readouterr().out.strip().splitlines()
    m = FINAL.match(out[-1])
    assert m, f"last line is {out[-1]!r}"
    assert m["platform"] == "cpu" and m["mfu"] == "na"  # no bf16 peak known for a CPU
    assert float(m["train"]) > 0 and float(m["decode"]) > 0
    # Micro-step and apply compile once each; the timed steps reuse them. Decode likewise.
    assert int(m["ct"]) == 2
    assert float(m["ps"]) > 0
    assert "compiles after warm-up 2, at the end 2" in out[-4]
    warm = re.search(r"compiles after warm-up (\d+), at the end (\d+)", out[-3])
    assert warm and warm[1] == warm[2] == m["cd"]
    assert out[-2].startswith("prefill: tiny-qwen3_5 DeltaNet layer, 1 x 64 tokens: chunked ")


def test_peak_table_and_bad_arguments() -> None:
    assert device.peak_flops("NVIDIA H200") == 989e12
    assert device.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert device.peak_flops("TPU v5 lite") == 197e12
    assert device.peak_flops("cpu") is None
    with pytest.raises(ValueError, match="--length >= 40"):
        device.main(["--length", "16"])
