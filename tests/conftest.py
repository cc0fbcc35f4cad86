"""Fixtures shared by every test directory."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def xla_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One persistent XLA compilation cache per session, in a fresh temporary directory.

    The processes the tests start (`--smoke` train runs, learner scripts) compile the same tiny
    programs; pointed at this cache (`xla_cache_env`), each program compiles once per session
    instead of once per process.
    """
    return tmp_path_factory.mktemp("xla_cache")


@pytest.fixture(scope="session")
def xla_cache_env(xla_cache_dir: Path) -> dict[str, str]:
    """The environment variables that point a JAX process at `xla_cache_dir`, every entry kept."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(xla_cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
