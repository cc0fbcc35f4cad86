"""Model stage, shared: safetensors files read memory-mapped on the host, for every family's import.

In: a `.safetensors` path. Out: HF-named numpy arrays (bfloat16 through ml_dtypes), not yet on
any device.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

# safetensors dtype names → numpy (bfloat16 through ml_dtypes, which numpy alone lacks).
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}  # fmt: skip


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file, memory-mapped read-only on the host.

    Nothing touches a device (safetensors' own flax reader makes each tensor a jax array on
    device 0), and a tensor's bytes are read only when something indexes into it, so the loader
    can hand each device no more than its shard of a model larger than one chip.
    """
    path = Path(path)
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    tensors: dict[str, np.ndarray] = {}
    for key, info in header.items():
        name = info["dtype"]
        if name != "BF16" and name not in SAFETENSORS_DTYPES:
            raise ValueError(
                f"{path.name}: tensor {key!r} has dtype {name}, not a float or int type"
            )
        dtype = bfloat16() if name == "BF16" else np.dtype(SAFETENSORS_DTYPES[name])
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - start != dtype.itemsize * int(np.prod(shape)):
            raise ValueError(f"{path.name}: tensor {key!r} has {end - start} bytes for {shape}")
        if end == start:
            tensors[key] = np.zeros(shape, dtype)
            continue
        tensors[key] = np.memmap(path, dtype, "r", offset=8 + size + start, shape=shape)
    return tensors


def bfloat16() -> np.dtype:
    import ml_dtypes  # a jax dependency; gives numpy a bfloat16

    return np.dtype(ml_dtypes.bfloat16)
