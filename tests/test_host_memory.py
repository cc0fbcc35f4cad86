"""`keep_freed_memory`: a freed large block is reused in-process instead of faulted in afresh.

Each case runs in a fresh interpreter: the allocator settings are process-wide and arena choice
is per thread, exactly as in the entry points that call it first.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harnessrl import host_memory

BLOCK = 256 << 20  # far above a thread arena's 64 MB cap and glibc's 32 MB mmap threshold
PAGES = BLOCK // 4096
# Allocate, touch and free the block once; then count the page faults of doing it again.
PROBE = f"""
import ctypes, ctypes.util, resource
from harnessrl.host_memory import keep_freed_memory
print(keep_freed_memory())
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def touch():
    p = libc.malloc({BLOCK})
    ctypes.memset(p, 1, {BLOCK})
    libc.free(p)
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or host_memory.platform.libc_ver()[0] != "glibc",
    reason="the setting is glibc's",
)


def _probe(enabled: str) -> tuple[str, int]:
    env = {**os.environ, host_memory.ENV: enabled}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], int(out[1])


@glibc_only
def test_a_freed_block_is_reused_without_page_faults() -> None:
    set_, faults = _probe("1")
    assert set_ == "True"
    assert faults < PAGES // 100, (
        f"{faults} page faults re-touching a reused {BLOCK >> 20} MB block"
    )


@glibc_only
def test_turned_off_the_block_is_unmapped_and_faulted_in_again() -> None:
    """The contrast that shows the probe measures something: glibc's default unmaps the block."""
    set_, faults = _probe("0")
    assert set_ == "False"
    assert faults > PAGES // 2


def test_does_nothing_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("", ""))
    assert host_memory.keep_freed_memory() is False
