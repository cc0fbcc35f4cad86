"""Engine stage, weight hot-swap: new params (in-process state, or an exported folder) → engine.

Incoming params are matched to the serving tree by name, checked for shape, cast to the serving
dtype and placed on the serving arrays' devices, so the compiled programs are reused as they are.
The engine installs a staged swap between two steps; `version` then changes with it.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import jax
from flax import nnx
from flax.nnx import traversals

from harnessrl.model import bf16_bits


class HoldsState(Protocol):
    state: nnx.State


def _flat_values(params: Any) -> dict[tuple[Any, ...], Any]:
    """An `nnx.State`, a Module, or a (nested) pure dict → {path: array}."""
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    if not isinstance(params, dict):
        raise TypeError(
            f"params must be an nnx.State, an nnx.Module or a dict of arrays, got {type(params).__name__}"
        )
    return dict(traversals.flatten_mapping(params))


def conform_params(params: Any, template: nnx.State) -> nnx.State:
    """`params` laid out exactly like `template` (same tree, dtypes, shardings) or ValueError."""
    incoming = _flat_values(params)
    current = dict(traversals.flatten_mapping(nnx.to_pure_dict(template)))
    missing = sorted(set(current) - set(incoming), key=str)
    unknown = sorted(set(incoming) - set(current), key=str)
    if missing or unknown:
        raise ValueError(
            f"params do not match the served model: missing {['/'.join(map(str, p)) for p in missing[:5]]}, "
            f"unexpected {['/'.join(map(str, p)) for p in unknown[:5]]}"
        )
    values = {}
    for path, old in current.items():
        new = incoming[path]
        if tuple(new.shape) != tuple(old.shape):
            raise ValueError(
                f"param {'/'.join(map(str, path))} has shape {tuple(new.shape)}, the served model "
                f"needs {tuple(old.shape)}"
            )
        if bf16_bits.is_bits(old):  # a bfloat16-serving engine: round, keep the bits
            new = new if bf16_bits.is_bits(new) else bf16_bits.to_bits(jax.numpy.asarray(new))
        values[path] = jax.device_put(jax.numpy.asarray(new, dtype=old.dtype), old.sharding)
    fresh = jax.tree.map(lambda x: x, template)  # new Variable objects; the template stays intact
    nnx.replace_by_pure_dict(fresh, traversals.unflatten_mapping(values))
    return fresh


class ParamSwap:
    """A staged params update and the policy version, shared by the caller and the engine thread."""

    def __init__(self, holder: HoldsState, version: int) -> None:
        self._holder = holder
        self._lock = threading.Lock()
        self._version = version
        self._staged: tuple[nnx.State, int, threading.Event] | None = None

    @property
    def version(self) -> int:
        return self._version

    @property
    def pending(self) -> bool:
        return self._staged is not None

    def stage(self, params: Any, version: int) -> threading.Event:
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an integer, got {version!r}")
        state = conform_params(params, self._holder.state)
        jax.block_until_ready(state)  # the swap itself must be instant for the engine thread
        applied = threading.Event()
        with self._lock:
            if self._staged is not None:
                self._staged[2].set()  # superseded: its waiter may go on, the newer one wins
            self._staged = (state, version, applied)
        return applied

    def apply_if_pending(self) -> bool:
        """Called by the engine between steps: install the staged params, if any (→ whether)."""
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            self._holder.state, self._version = staged[0], staged[1]
            staged[2].set()
        return staged is not None


def load_params(path: str) -> nnx.State:
    """An exported model folder (HF safetensors) → its params, via the model loader."""
    from harnessrl.model.formats.load import load_model

    return nnx.state(load_model(path).model, nnx.Param)
