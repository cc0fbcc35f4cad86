"""Learner tests share the session's persistent XLA compilation cache (`xla_cache_dir`).

The tiny model's programs are identical across tests and across the subprocesses that the
multi-device, multi-process and kill-and-resume tests start, so each compiles once per session
instead of once per Learner. In this process the cache is switched off again when the learner
tests finish.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest
from jax._src import compilation_cache

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CACHE_OPTIONS = {
    "jax_compilation_cache_dir": None,  # filled per session
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
}


@pytest.fixture(scope="session", autouse=True)
def in_process_xla_cache(xla_cache_dir: Path) -> Iterator[Path]:
    previous = {name: getattr(jax.config, name) for name in CACHE_OPTIONS}
    for name, value in {**CACHE_OPTIONS, "jax_compilation_cache_dir": str(xla_cache_dir)}.items():
        jax.config.update(name, value)
    yield xla_cache_dir
    for name, value in previous.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


@pytest.fixture
def run_script(xla_cache_env: dict[str, str]):
    """Run `tests/learner/SCRIPT` in a fresh interpreter with the shared compilation cache."""

    def run(
        script: str,
        *args: str,
        devices: int = 1,
        timeout: float = 300,
        env: dict | None = None,
        background: bool = False,
    ):
        full_env = {
            **os.environ,
            # The caller's XLA flags (codegen variants) still apply to the subprocess.
            "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
            f"--xla_force_host_platform_device_count={devices}".strip(),
            "JAX_PLATFORMS": "cpu",
            **xla_cache_env,
            **(env or {}),
        }
        cmd = [sys.executable, str(HERE / script), *args]
        if background:
            return subprocess.Popen(
                cmd,
                cwd=REPO,
                env=full_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        proc = subprocess.run(
            cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout
        )
        assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
        return proc.stdout

    return run
