"""`python -m harnessrl.benchmarks.prefill` on the tiny Qwen3.5 shape: both forms of the delta
rule timed on one prompt chunk, checked against each other, and its one-line summary."""

from __future__ import annotations

import re

import pytest

from harnessrl.benchmarks import prefill
from harnessrl.model.families.qwen3_5 import SHAPES as QWEN35_SHAPES
from harnessrl.model.families.qwen3_5 import Qwen35Config

FINAL = re.compile(
    r"^prefill: chunked_tokens_per_s=(?P<c>\d+\.\d) recurrent_tokens_per_s=(?P<r>\d+\.\d) "
    r"speedup=(?P<s>\d+\.\d\d) max_abs_diff=(?P<d>\S+)$"
)


def test_reports_both_forms_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    prefill.main(["--shape", "tiny-qwen3_5", "--length", "40", "--chunk", "16", "--repeats", "2"])
    out = capsys.readouterr().out.strip().splitlines()
    m = FINAL.match(out[-1])
    assert m, f"last line is {out[-1]!r}"
    assert float(m["c"]) > 0 and float(m["r"]) > 0 and float(m["s"]) > 0
    assert "1 x 40 tokens, chunk 16" in out[0]


def test_the_agreement_check_catches_a_wrong_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunked rule that drops the carried state (the bug this benchmark would otherwise time
    as a speedup) fails the comparison instead of reporting it."""
    real = prefill.gdn.chunked_gated_delta_rule
    monkeypatch.setattr(
        prefill.gdn,
        "chunked_gated_delta_rule",
        lambda *a: real(*a[:-1], None),  # the last argument is the slot's state
    )
    cfg = Qwen35Config(**QWEN35_SHAPES["tiny-qwen3_5"])
    with pytest.raises(AssertionError, match="chunked and recurrent differ"):
        prefill.compare(cfg, 1, 24, 8, 1)


def test_bad_arguments_say_what_to_pass(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        prefill.main(["--shape", "nope"])
    assert "choose from" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prefill.main(["--length", "1"])
    assert "--length >= 2" in capsys.readouterr().err
