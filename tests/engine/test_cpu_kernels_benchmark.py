"""`python -m harnessrl.benchmarks.cpu_kernels` on the tiny model: both engines decode, and the last
line reports each precision's rates and their ratio."""

from __future__ import annotations

import re

import pytest

from harnessrl.benchmarks import cpu_kernels as benchmark
from harnessrl.engine import cpu_kernels

FINAL = re.compile(
    r"^cpu_kernels: speedup=(?P<speedup>\d+\.\d\d) "
    r"tokens_per_s_kernel_float32=(?P<kernel>\d+\.\d) tokens_per_s_xla_float32=(?P<xla>\d+\.\d) "
    r"speedup_float32=(?P<ratio>\d+\.\d\d)$"
)


@pytest.mark.skipif(not cpu_kernels.load(), reason="the kernel needs an x86-64 CPU and a compiler")
def test_tiny_run_reports_both_engines_rates(capsys: pytest.CaptureFixture[str]) -> None:
    benchmark.main(["--model", "tiny", "--rounds", "1", "--tokens", "4", "--prompt", "8",
                    "--weight-dtypes", "float32"])  # fmt: skip
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = FINAL.match(last)
    assert m, f"last line is {last!r}"
    kernel, xla = float(m["kernel"]), float(m["xla"])
    assert kernel > 0 and xla > 0
    assert float(m["ratio"]) == pytest.approx(kernel / xla, abs=0.011)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        benchmark.main(["--weight-dtypes", "float16"])
    with pytest.raises(SystemExit):
        benchmark.main(["--rounds", "0"])
