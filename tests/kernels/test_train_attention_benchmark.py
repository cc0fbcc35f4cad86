"""`python -m harnessrl.benchmarks.train_attention` at a small size: both sides run, and the last
line reports their times and ratio."""

from __future__ import annotations

import re

import pytest

from harnessrl.benchmarks import train_attention as benchmark
from harnessrl.kernels import build

FINAL = re.compile(
    r"^train_attention: speedup=(?P<speedup>\d+\.\d\d) "
    r"ms_kernel=(?P<kernel>\d+\.\d{3}) ms_xla=(?P<xla>\d+\.\d{3})$"
)


@pytest.mark.skipif(not build.load(), reason="the kernel needs an x86-64 CPU and a compiler")
def test_small_run_reports_both_times_and_their_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    benchmark.main(["--rows", "2", "--length", "64", "--rounds", "2"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = FINAL.match(last)
    assert m, f"last line is {last!r}"
    kernel, xla = float(m["kernel"]), float(m["xla"])
    assert kernel > 0 and xla > 0
    assert float(m["speedup"]) == pytest.approx(xla / kernel, rel=0.05)  # ms are rounded


def test_bad_arguments_are_refused() -> None:
    for argv in (["--rounds", "0"], ["--length", "8"], ["--heads", "5"], ["--head-dim", "32"]):
        with pytest.raises(SystemExit):
            benchmark.main(argv)
