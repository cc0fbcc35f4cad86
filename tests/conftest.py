"""Fixtures shared by every test directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import jax
import pytest
from jax._src import compilation_cache


@pytest.fixture(scope="session")
def xla_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One persistent XLA compilation cache per session, in a fresh temporary directory.

    The processes the tests start (`--smoke` train runs, learner scripts) compile the same tiny
    programs; pointed at this cache (`xla_cache_env`), each program compiles once per session
    instead of once per process.
    """
    return tmp_path_factory.mktemp("xla_cache")


def _cache_options(cache_dir: Path) -> dict[str, str | float]:
    """The JAX options that compile through `cache_dir`, every entry kept."""
    return {
        "jax_compilation_cache_dir": str(cache_dir),
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }


@pytest.fixture(scope="session")
def xla_cache_env(xla_cache_dir: Path) -> dict[str, str]:
    """The environment variables that point a JAX process at `xla_cache_dir` (each option's
    name in capitals)."""
    return {name.upper(): str(value) for name, value in _cache_options(xla_cache_dir).items()}


@pytest.fixture(scope="session", autouse=True)
def in_process_xla_cache(xla_cache_dir: Path) -> Iterator[Path]:
    """This process compiles through the session's cache too: tests build many engines and
    learners of the same tiny shapes, each a new `jax.jit` that would compile anew; an identical
    program now compiles once per session and later tests load it."""
    options = _cache_options(xla_cache_dir)
    previous = {name: getattr(jax.config, name) for name in options}
    for name, value in options.items():
        jax.config.update(name, value)
    yield xla_cache_dir
    for name, value in previous.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()
