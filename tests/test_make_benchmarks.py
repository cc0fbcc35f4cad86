"""`make bench` runs the CPU benchmarks the docs describe, each as `python -m harnessrl.benchmarks.NAME`."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ACCELERATOR_ONLY = {"device"}  # measures a GPU or TPU; on CPU it only runs the same code on a toy


def bench_names(*args: str) -> list[str]:
    proc = subprocess.run(
        ["make", "-n", "bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    loop = re.search(r"for name in ([\w ]+); do", proc.stdout)
    assert loop, f"make -n bench runs no benchmark:\n{proc.stdout}"
    assert "-m harnessrl.benchmarks.$name" in proc.stdout, proc.stdout
    return loop[1].split()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_bench_runs_every_documented_cpu_benchmark() -> None:
    names = bench_names()
    modules = {
        p.stem if p.is_file() else p.name
        for p in (ROOT / "harnessrl" / "benchmarks").iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__main__.py").is_file()
    }
    assert set(names) == modules - ACCELERATOR_ONLY and len(names) == len(set(names)), names
    docs = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    for name in names:
        assert importlib.util.find_spec(f"harnessrl.benchmarks.{name}"), name
        assert f"python -m harnessrl.benchmarks.{name}" in docs, f"{name} is not documented"
    assert bench_names("BENCHMARKS=sidecar store") == ["sidecar", "store"]
