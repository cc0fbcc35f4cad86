"""`python -m harnessrl.benchmarks.host_memory` on a tiny model: both allocator settings, each in
its own process, and its one-line summary."""

from __future__ import annotations

import os
import re

import pytest

from harnessrl.benchmarks import host_memory

FINAL = re.compile(
    r"^host_memory: step_s_kept=(?P<kept>\d+\.\d\d) step_s_default=(?P<default>\d+\.\d\d) "
    r"speedup=\d+\.\d\d faults_per_step_kept=(?P<fk>\d+) faults_per_step_default=(?P<fd>\d+) "
    r"system_s_kept=\d+\.\d\d system_s_default=\d+\.\d\d$"
)


@pytest.mark.skipif(
    not os.environ.get("HARNESSRL_SLOW"),
    reason="two fresh processes each compile a learner step (about 30 s): HARNESSRL_SLOW=1",
)
def test_runs_both_sides_and_ends_with_its_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "tiny", "--rows", "2", "--length", "64", "--steps", "1", "--rounds", "1"]
    host_memory.main(argv)  # each side checks its process reported the setting it was given
    out = capsys.readouterr().out.strip().splitlines()
    m = FINAL.match(out[-1])
    assert m, f"last line is {out[-1]!r}"
    assert float(m["kept"]) > 0 and float(m["default"]) > 0


def test_bad_arguments_say_what_to_pass(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        host_memory.main(["--length", "16"])
    assert "--length >= 40" in capsys.readouterr().err
