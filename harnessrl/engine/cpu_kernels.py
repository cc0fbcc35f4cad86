"""Engine stage, CPU kernels: a decode step's matmuls and attention in C++, read in place.

`matvec`: activation rows `[rows, k]` float32 times layer `i` of a stacked weight `[layers, k, n]`
(or `[layers, n, k]`), float32 or bfloat16 words (`model.bf16_bits`) → `[rows, n]` float32.
`decode_attention`: one query per cache slot against that slot's own cache positions → `[slots,
heads, head_dim]`. `cpu_kernels.cc` is compiled with the system's C++ compiler on first use into a
per-user cache and registered as XLA FFI targets; `load()` returns False where it cannot be (no
compiler, not an x86-64 CPU backend), and the decoder then keeps XLA's ops. See docs/serve.md.
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
import jax.numpy as jnp

from harnessrl.model.decoder import DecodeKernels

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cc")
TARGET = "harnessrl_matvec"
ATTENTION_TARGET = "harnessrl_decode_attention"
# Slots the engine sends through the kernels: beyond 8 rows the matmul re-reads each weight per
# group of 8, and it still beat XLA's dots at 16 and 32 (docs/serve.md); larger is not measured.
MAX_SLOTS = 32
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
    """Compile `cpu_kernels.cc` into `out_dir` (once per source, compiler and jax version) → the .so.

    Raises RuntimeError with the compiler's output when it fails.
    """
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    # -march=native: the library is for this CPU, so its model and flags are part of the key.
    cpu = "\n".join(
        line for line in _cpuinfo().splitlines() if line.startswith(("model name", "flags"))
    )
    key = hashlib.sha256(
        "\0".join((SOURCE.read_text(), version, cpu, jax.__version__, *FLAGS)).encode()
    ).hexdigest()[:16]
    library = out_dir / f"cpu_kernels-{key}.so"
    if library.exists():
        return library
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: a concurrent build never sees a half-written file.
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        partial = Path(tmp) / library.name
        command = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(partial)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
        os.replace(partial, library)
    return library


@functools.cache
def _built(compiler: str) -> Path:  # an engine per process, not a compiler query per engine
    return build(compiler, cache_dir())


@functools.cache
def _register(library: Path) -> None:
    handlers = ctypes.cdll.LoadLibrary(str(library))
    for target, handler in (
        (TARGET, handlers.HarnessrlMatVec),
        (ATTENTION_TARGET, handlers.HarnessrlDecodeAttention),
    ):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")


def load(backend: str | None = None, compiler: str | None = None) -> bool:
    """Build (or find built) and register the kernel; False, with a logged reason, where it
    cannot run here: then the decode matmuls stay XLA dots.

    Only x86-64 CPU backends use it. `compiler` defaults to `$CXX`, else `g++` or `c++` on PATH.
    """
    backend = backend or jax.default_backend()
    if backend != "cpu" or platform.machine().lower() not in ("x86_64", "amd64"):
        log.info("decode matmuls: XLA dots (the C++ kernel is for x86-64 CPU backends)")
        return False
    compiler = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        log.warning("decode matmuls: XLA dots (no C++ compiler found; set CXX to use the kernel)")
        return False
    try:
        _register(_built(compiler))
    except (OSError, RuntimeError) as err:
        log.warning("decode matmuls: XLA dots (the C++ kernel did not build: %s)", err)
        return False
    return True


def matvec(x_rk: jax.Array, w_lkn: jax.Array, layer: jax.Array, transposed: bool) -> jax.Array:
    """`x_rk @ w_lkn[layer]` (`x_rk @ w_lnk[layer].T` if `transposed`), float32 `[rows, n]`.

    Needs `load()` to have returned True. The weights are read in place from the stacked array.
    """
    n = w_lkn.shape[1] if transposed else w_lkn.shape[2]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x_rk.shape[0], n), jnp.float32))
    return call(
        x_rk.astype(jnp.float32), w_lkn, jnp.asarray(layer, jnp.int32), transposed=transposed
    )


def decode_attention(
    q_she: jax.Array,
    k_lsmke: jax.Array,
    v_lsmke: jax.Array,
    layer: jax.Array,
    positions_s: jax.Array,
) -> jax.Array:
    """One query per cache slot against that slot's cache positions `0..positions_s[s]` of layer
    `layer` (float32 caches), read in place; grouped-query heads as `attention.attend`. A slot at
    position -1 gets zeros. → `[slots, heads, head_dim]` float32."""
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q_she.shape, jnp.float32))
    return call(
        q_she.astype(jnp.float32),
        k_lsmke,
        v_lsmke,
        jnp.asarray(layer, jnp.int32),
        positions_s.astype(jnp.int32),
    )


KERNELS = DecodeKernels(matvec=matvec, attention=decode_attention)
