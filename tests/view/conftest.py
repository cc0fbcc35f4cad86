"""The viewer's fixtures: one real smoke run (made once per session), rollouts planted in its store,
the viewer serving it, and a headless Chromium.

The smoke run's harness is the unchanged example agent with a system message full of markup, so
every page that shows trace content is tested against script in it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

# The throwaway PostgreSQL cluster of the trace-store tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "traces"))
from browser import Browser
from pg_cluster import pg_dsn, pg_server  # noqa: F401  (fixtures)
from synthetic import EVIL, SmokeRun, long_rollout, planted_break

from harnessrl.traces import open_store
from harnessrl.view.config import ViewConfig
from harnessrl.view.serve import ViewerHandle, start_viewer

ROOT = Path(__file__).resolve().parents[2]
HARNESS = (
    "{python} {examples}/answer_agent.py --max-tokens 8 --max-attempts 2 --feedback "
    f"--system '{EVIL}'"
)


@pytest.fixture(scope="session")
def smoke(tmp_path_factory: pytest.TempPathFactory, xla_cache_env: dict[str, str]) -> SmokeRun:
    """`python -m harnessrl.train --smoke run.view=true` with the markup harness; the viewer it
    starts is fetched while the run goes on."""
    out = tmp_path_factory.mktemp("view") / "smoke"
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, **xla_cache_env}
    argv = [
        sys.executable, "-m", "harnessrl.train", "--smoke", f"run.out_dir={out}",
        "run.view=true", "run.display=false", "run.tensorboard=false", "run.export_hf=false",
        f"rollout.harness={HARNESS}",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines, live = [], ""
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("view: ") and not live:
                with urllib.request.urlopen(line.split()[1], timeout=30) as reply:
                    live = reply.read().decode()
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stdout = "".join(lines)
    assert proc.returncode == 0, stdout[-4000:]
    url = f"sqlite:///{out / 'traces.db'}"
    with open_store(url) as store:
        planted_break(store, "planted-break")
        long_rollout(store, "long-run", calls=200, tokens=64_000)
    return SmokeRun(out, url, stdout, live)


@pytest.fixture(scope="session")
def viewer(smoke: SmokeRun) -> Iterator[ViewerHandle]:
    handle = start_viewer(ViewConfig(store=smoke.store_url, runs=str(smoke.out), port=0))
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    binary = Browser.find()
    if binary is None:
        pytest.skip("no chromium binary: install Debian's `chromium` to run the browser tests")
    b = Browser(binary, tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()
