"""Process setup: keep the memory XLA's CPU programs free for the next step, not the OS.

XLA:CPU allocates each execution's temporaries as one block and frees it when the execution
ends: 5.5 GB for the learner's SmolLM2 micro-step at 8 x 256 tokens. glibc serves a block that
large with a fresh `mmap` (a thread's own arena cannot hold it) and unmaps it on free, so every
step faults the whole block in again, page by page, with the kernel zeroing each page: 1.7
million page faults and about 4 s of system time per learner step, and more once a second
runtime shares the process. `keep_freed_memory` has glibc serve every block from its one main
heap and never hand freed memory back, so the next step reuses the pages the last one touched.
The price is that a process's resident memory stays at its peak, which for the trainer is the
working set it comes back to every step anyway.

`python -m harnessrl.train` and the learner-side benchmarks call it first, before any XLA thread
starts; `HARNESSRL_KEEP_FREED_MEMORY=0` turns it off. The standalone server does not: its decode
temporaries are far smaller, and side by side it measured no faster with it. Elsewhere than glibc
(macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

# mallopt parameters, from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
ENV = "HARNESSRL_KEEP_FREED_MEMORY"


def keep_freed_memory() -> bool:
    """Set glibc's allocator to reuse freed memory in-process; True if it is now set."""
    if os.environ.get(ENV, "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    # One arena: blocks above a thread arena's 64 MB cap come from the main heap instead of a
    # private mmap. Arena choice is per thread, so this must run before XLA starts its threads.
    settings = (
        (M_ARENA_MAX, 1),
        (M_MMAP_MAX, 0),  # no block gets its own mmap, so none is unmapped on free
        (M_TRIM_THRESHOLD, -1),  # read as SIZE_MAX: the heap's free top is never trimmed
    )
    return all(libc.mallopt(param, value) == 1 for param, value in settings)
