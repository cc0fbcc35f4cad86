"""Learner stage: an NNX model seen as plain parameter trees with mesh shardings.

In: a Flax NNX module whose params carry logical axis names (every family's decoder, `harnessrl.model.registry`).
Out: `ModelParts` (graph definition and non-trainable state), the params as a nested dict of
arrays, their `NamedSharding`s from THE rules table, and the way back to a module (`merge`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from harnessrl.learner.mesh import LOGICAL_AXIS_RULES, Rules
from harnessrl.model.sharding import logical_to_spec


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """What stays fixed while params change: how to rebuild the module around a param dict."""

    graphdef: Any
    rest: list[Any]  # non-Param states (e.g. RoPE tables), closed over as constants
    state_treedef: Any  # tree structure of the nnx.State of Params
    logical: tuple[tuple[str | None, ...], ...]  # logical axes per leaf, in leaf order

    def merge(self, params: Any) -> nnx.Module:
        """Module with `params` (a dict from `split_model`) as its weights; works under jit."""
        return nnx.merge(self.graphdef, self.params_state(params), *self.rest)

    def params_state(self, params: Any) -> nnx.State:
        return jax.tree.unflatten(self.state_treedef, jax.tree.leaves(params))


def split_model(
    model: nnx.Module,
    compute_dtype: str | None = None,
    param_dtype: str | None = None,
    remat: bool | None = None,
    scan_unroll: int | None = None,
) -> tuple[ModelParts, dict[str, Any]]:
    """Split `model` into parts and a param dict, optionally with new numerics.

    Numerics live in the model's config (`model.cfg`), which is part of the static graph; changing
    them rebuilds the graph abstractly (no new weights) and casts the existing params.
    """
    changes = {
        k: v
        for k, v in (
            ("compute_dtype", compute_dtype),
            ("param_dtype", param_dtype),
            ("remat", remat),
            ("scan_unroll", scan_unroll),
        )
        if v is not None
    }
    graphdef, state, *rest = nnx.split(model, nnx.Param, ...)
    cfg = getattr(model, "cfg", None)
    if changes and cfg is not None and any(getattr(cfg, k) != v for k, v in changes.items()):
        build: Any = type(model)
        template = nnx.eval_shape(lambda: build(cfg.replace(**changes), rngs=nnx.Rngs(0)))
        graphdef = nnx.split(template, nnx.Param, ...)[0]
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    logical = tuple(tuple(v.get_metadata().get("out_sharding") or ()) for v in variables)
    for v, names in zip(variables, logical, strict=True):
        if names and len(names) != v.get_value().ndim:
            raise ValueError(f"param of shape {v.get_value().shape} is annotated with {names}")
    params = nnx.to_pure_dict(state)
    # The unflatten in ModelParts.merge relies on both trees listing leaves in the same order.
    assert all(a is b for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state), strict=True))
    if param_dtype is not None:
        params = jax.tree.map(lambda x: jnp.asarray(x, param_dtype), params)
    return ModelParts(graphdef, rest, jax.tree.structure(state), logical), params


def param_shardings(
    parts: ModelParts, params: Any, mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES
) -> Any:
    """`NamedSharding` per param through THE rules table (or its ZeRO-3 variant, `rules`); a
    dimension its axes cannot split stays whole."""
    leaves, treedef = jax.tree.flatten(params)
    shardings = []
    for leaf, names in zip(leaves, parts.logical, strict=True):
        shape = np.shape(leaf)
        axes = names if names else (None,) * len(shape)
        shardings.append(NamedSharding(mesh, logical_to_spec(axes, rules, shape, mesh)))
    return jax.tree.unflatten(treedef, shardings)


def place(tree: Any, shardings: Any) -> Any:
    """Host (or single-device) arrays → global sharded arrays; each process fills its own shards.

    An array that already has exactly this sharding (a model loaded under the learner's mesh,
    `harnessrl.model.formats.load`) is taken as it is: no copy, and no gather through the host, which a
    multi-process array would not allow. Anything else, even a single-device array a 1-device
    mesh would cover, is copied: the steps donate their inputs and expect these very shardings.
    """

    def put(x: Any, sharding: NamedSharding) -> jax.Array:
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


def abstract_like(tree: Any, shardings: Any) -> Any:
    """`ShapeDtypeStruct`s with shardings: restore targets and compile-time stand-ins."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, shardings
    )


def gather_to_host(tree: Any) -> Any:
    """Full numpy copies of (possibly multi-process) sharded arrays, on every process."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree.map(np.asarray, jax.device_get(tree))
