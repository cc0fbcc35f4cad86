"""Building and registering the C++ CPU kernels, and where they decline to load."""

from __future__ import annotations

import logging
import os
import shutil

import pytest

from harnessrl.kernels import build

pytestmark = pytest.mark.skipif(
    not build.load(), reason="the CPU kernels need an x86-64 CPU backend and a C++ compiler"
)


def test_build_reuses_its_library_and_reports_a_failing_compiler(tmp_path, caplog):
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    assert compiler is not None  # load() found one, or this module would be skipped
    first = build.build(compiler, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build.build(compiler, tmp_path) == first
    assert first.stat().st_mtime_ns == stamp  # found, not rebuilt
    with pytest.raises(RuntimeError, match="failed"):
        build.build("false", tmp_path / "broken")
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.load("cpu", compiler="false") is False
    assert "did not build" in caplog.text
    assert build.load("tpu") is False


def test_every_target_is_exported_by_the_library():
    import ctypes

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    assert compiler is not None
    # The library load() built and registered (found in its cache, not built again).
    library = ctypes.cdll.LoadLibrary(str(build.build(compiler, build.cache_dir())))
    for symbol in build.TARGETS.values():
        assert getattr(library, symbol) is not None
