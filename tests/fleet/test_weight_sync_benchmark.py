"""`python -m harnessrl.benchmarks.weight_sync` pushes to real embedded servers, which refuse a load
without their admin token: every path, every replica count, reaches its figure."""

from __future__ import annotations

import subprocess
import sys

from harnessrl.benchmarks import weight_sync as bench


def test_the_benchmark_pushes_through_every_path_to_every_replica_count() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "harnessrl.benchmarks.weight_sync", "--mb", "2", "--rounds", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("weight_sync: ")
    fields = dict(kv.split("=") for kv in last.removeprefix("weight_sync: ").split())
    for n in bench.REPLICAS:
        for mode in bench.MODES:
            assert float(fields[f"{mode}_s_per_gb_n{n}"]) > 0
