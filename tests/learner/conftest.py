"""Learner tests: scripts run in fresh interpreters that share the session's XLA cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


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
