"""Model stage: the logical axis names of the decoder, and what a runtime's rules make of them.

In: logical names from the closed set below, on parameters and activations, and the table of
(logical, mesh axes) rules that the runtime owning the mesh hands in, as an argument or through
Flax's `nnx.logical_axis_rules` context. Out: `PartitionSpec`s and activation constraints. No
table lives here: the runtime decides (the learner keeps its table beside its meshes).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import Mesh, PartitionSpec

# Every name model code may use; a runtime's table has a rule for each.
LOGICAL_AXES: tuple[str, ...] = (
    "batch",
    "length",
    "embed",
    "mlp",
    "heads",
    "kv_heads",
    "head_dim",
    "vocab",
    "layers",
)
# (logical axis, mesh axis or axes or None), as `nnx.logical_axis_rules` takes them.
Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def context_rules() -> Rules:
    """The rules of the enclosing `nnx.logical_axis_rules(...)`; a mesh without them is an error."""
    rules = core_spmd.get_logical_axis_rules()
    if not rules:
        raise ValueError(
            "the decoder is used under a mesh but no logical-axis rules are set; the runtime "
            "that owns the mesh hands them in: `with jax.set_mesh(mesh), "
            "nnx.logical_axis_rules(rules):` (the learner's `use_mesh(mesh)` does both)"
        )
    return rules


def logical_to_spec(
    logical: Sequence[str | None],
    rules: Rules,
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> PartitionSpec:
    """Logical names → PartitionSpec through `rules`; a mesh axis is used at most once per array.

    With `shape` and `mesh`, a dimension its mesh axes do not divide stays replicated (e.g.
    SmolLM2's 9 heads on tensor=2), and size-1 mesh axes drop out.
    """
    table = dict(rules)
    used: set[str] = set()
    out: list[Any] = []
    for i, name in enumerate(logical):
        if name is not None and name not in table:
            raise ValueError(
                f"logical axis {name!r} has no rule in the logical-axis rules handed in "
                f"(they cover {sorted(table)}); add one to the runtime's table"
            )
        target = None if name is None else table[name]
        axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        axes = tuple(a for a in axes if a not in used)
        if shape is not None and mesh is not None:
            axes = tuple(a for a in axes if mesh.shape[a] > 1)
            if axes and shape[i] % math.prod(mesh.shape[a] for a in axes):
                axes = ()
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def constrain(x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
    """Logical sharding constraint on an activation; a no-op when no mesh is set."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_to_spec(logical, context_rules())
    if mesh.are_all_axes_explicit:
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


@contextlib.contextmanager
def param_sharding() -> Iterator[None]:
    """New params: sharded eagerly by the context's rules under a mesh, plain arrays without."""
    if jax.sharding.get_abstract_mesh().empty:
        with nnx.use_eager_sharding(False):
            yield
    else:
        context_rules()
        yield
