"""Build and register the C++ CPU kernels (`*.cc` here) as XLA FFI targets.

The sources are compiled with the system's C++ compiler on first use (`-O3 -march=native`) into a
per-user cache, keyed by the sources, the compiler, this CPU and the jax version, and registered
with XLA's CPU platform. `load()` returns False where they cannot run (no compiler, not an x86-64
CPU backend); callers then keep XLA's ops. The serving kernels are `harnessrl.engine.cpu_kernels`,
the learner's attention `harnessrl.kernels.train_attention`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (HERE / "decode.cc", HERE / "train_attention.cc")
HEADERS = (HERE / "task_runner.h", HERE / "vectors.h")
# FFI target name → the handler symbol the library exports.
TARGETS = {
    "harnessrl_matvec": "HarnessrlMatVec",
    "harnessrl_decode_attention": "HarnessrlDecodeAttention",
    "harnessrl_attention_fwd": "HarnessrlAttentionForward",
    "harnessrl_attention_bwd": "HarnessrlAttentionBackward",
}
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-w")


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "harnessrl" / "kernels"


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()


def build(compiler: str, out_dir: Path) -> Path:
    """Compile the kernels into `out_dir` (once per sources, compiler, CPU and jax) → the .so.

    Raises RuntimeError with the compiler's output when it fails.
    """
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    # -march=native: the library is for this CPU, so its model and flags are part of the key.
    cpu = "\n".join(
        line for line in _cpuinfo().splitlines() if line.startswith(("model name", "flags"))
    )
    texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
    key = hashlib.sha256(
        "\0".join((*texts, version, cpu, jax.__version__, *FLAGS)).encode()
    ).hexdigest()[:16]
    library = out_dir / f"cpu_kernels-{key}.so"
    if library.exists():
        return library
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: a concurrent build never sees a half-written file.
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        partial = Path(tmp) / library.name
        command = [
            compiler,
            *FLAGS,
            f"-I{jax.ffi.include_dir()}",
            f"-I{HERE}",
            *map(str, SOURCES),
            "-o",
            str(partial),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
        os.replace(partial, library)
    return library


@functools.cache
def _built(compiler: str) -> Path:  # once per process, not a compiler query per caller
    return build(compiler, cache_dir())


@functools.cache
def _register(library: Path) -> None:
    handlers = ctypes.cdll.LoadLibrary(str(library))
    for target, symbol in TARGETS.items():
        handler = getattr(handlers, symbol)
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")


def load(backend: str | None = None, compiler: str | None = None) -> bool:
    """Build (or find built) and register the kernels; False, with a logged reason, where they
    cannot run here: then callers keep XLA's ops.

    Only x86-64 CPU backends use them. `compiler` defaults to `$CXX`, else `g++` or `c++` on PATH.
    """
    backend = backend or jax.default_backend()
    if backend != "cpu" or platform.machine().lower() not in ("x86_64", "amd64"):
        log.info("CPU kernels: not used (they are for x86-64 CPU backends); XLA's ops instead")
        return False
    compiler = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        log.warning("CPU kernels: no C++ compiler found (set CXX to use them); XLA's ops instead")
        return False
    try:
        _register(_built(compiler))
    except (OSError, RuntimeError) as err:
        log.warning("CPU kernels: did not build (%s); XLA's ops instead", err)
        return False
    return True
