from __future__ import annotations

import re

from harnessrl.benchmarks.packing import main


def test_benchmark_runs_and_ends_with_its_summary_line(capsys):
    main(["--steps", "2", "--groups", "2", "--group-size", "2"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(
        r"packing: efficiency=([\d.]+) padmax_efficiency=([\d.]+) tokens_per_s=(\d+) shapes=(\d+)",
        last,
    )
    assert m is not None, last
    assert 0 < float(m[1]) <= 1 and 0 < float(m[2]) <= 1 and int(m[4]) <= 5
