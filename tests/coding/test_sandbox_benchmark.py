from __future__ import annotations

import re

from taskkit import needs_bwrap

from harnessrl.benchmarks.sandbox import main


@needs_bwrap
def test_benchmark_times_both_isolations_and_ends_with_its_summary_line(capsys):
    main(["--tasks", "2", "--no-plugin-autoload"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split()[0] for ln in lines[1:3]] == ["bwrap", "plain"]
    assert any("NOT isolated" in ln for ln in lines)
    m = re.fullmatch(r"sandbox: setup_ms_p50=(\d+) grade_ms_p50=(\d+) tasks=(\d+)", lines[-1])
    assert m is not None, lines[-1]
    assert int(m[1]) > 0 and int(m[2]) > 0 and int(m[3]) == 2
