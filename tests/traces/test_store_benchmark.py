"""`python -m harnessrl.benchmarks.store` measures both stores and its rates are real commits."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from harnessrl.benchmarks import store as bench
from harnessrl.traces import open_store


def test_the_benchmark_measures_sqlite_and_postgres(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bench.main(["--postgres", pg_dsn, "--prompt-tokens", "64", "--completion-tokens", "8",
                "--writers", "2", "--seconds", "0.2"])  # fmt: skip
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("store: ")
    fields = dict(kv.split("=") for kv in last.removeprefix("store: ").split())
    for name in ("sqlite", "postgres"):
        for group in bench.GROUPS:
            assert float(fields[f"{name}_calls_s_g{group}"]) > 0
    # What it reports is what it wrote: every measured call is in the database, whole.
    store = open_store(pg_dsn)
    try:
        rollouts = store.rollouts()
        assert len(rollouts) == 2 * len(bench.GROUPS)
        calls = store.calls(rollouts[0].rollout_id)
        assert calls and all(len(c.prompt_token_ids) == 64 for c in calls)
        assert [c.seq for c in calls] == list(range(len(calls)))
    finally:
        store.close()


def test_measure_counts_only_committed_calls(tmp_path: pathlib.Path) -> None:
    url = f"sqlite:///{tmp_path / 't.db'}"
    calls = [bench.make_call(np.random.default_rng(0), "r", 16, 4) for _ in range(4)]
    rate = bench.measure(url, calls, 4, 1, 0.2)
    store = open_store(url)
    try:
        (rollout,) = store.rollouts()
        stored = store.count_calls(rollout.rollout_id)
    finally:
        store.close()
    assert stored % 4 == 0 and stored > 0
    assert rate > 0
    assert bench.record_bytes(calls[0]) > 4 * 16  # the request body alone is 4 chars per token


def test_bad_sizes_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--writers", "0"])
    assert "--writers must be >= 1" in capsys.readouterr().err
