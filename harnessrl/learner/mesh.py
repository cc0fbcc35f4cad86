"""Device mesh and THE logical-axis sharding rules.

In: a mesh spec (`data=2,fsdp=4,tensor=1`, a preset name, or sizes from a tpu_configs YAML).
Out: a `jax.sharding.Mesh` with axes (data, fsdp, tensor) and the rules that map the model's
logical axis names onto it. Model code names only logical axes; this table is the one place
where they meet hardware.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")

# (logical axis, mesh axis or axes). Every logical name used in harnessrl/model appears exactly once.
# Size-1 mesh axes make a rule a no-op, so one table serves every preset.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("vocab", "tensor"),
    ("layers", None),
)

# Named shapes for --mesh; -1 takes whatever devices are left.
MESH_PRESETS: dict[str, dict[str, int]] = {
    "dp": {"data": -1, "fsdp": 1, "tensor": 1},
    "fsdp": {"data": 1, "fsdp": -1, "tensor": 1},
    "fsdp_tp": {"data": 1, "fsdp": -1, "tensor": 2},
    "serve": {"data": 1, "fsdp": 1, "tensor": -1},
}


def parse_mesh_spec(spec: str, num_devices: int) -> dict[str, int]:
    """`"data=2,fsdp=-1"` or a preset name → concrete sizes for every mesh axis."""
    if spec in MESH_PRESETS:
        sizes = dict(MESH_PRESETS[spec])
    else:
        sizes = {axis: 1 for axis in MESH_AXES}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, sep, value = part.partition("=")
            if not sep or name not in MESH_AXES:
                raise ValueError(
                    f"mesh spec {spec!r}: expected comma-separated AXIS=SIZE with AXIS in "
                    f"{MESH_AXES} or a preset in {sorted(MESH_PRESETS)}; got {part!r}"
                )
            try:
                sizes[name] = int(value)
            except ValueError as err:
                raise ValueError(f"mesh spec {spec!r}: size of {name!r} is not an integer") from err
    return resolve_mesh_sizes(sizes, num_devices, source=spec)


def resolve_mesh_sizes(sizes: dict[str, int], num_devices: int, source: str = "") -> dict[str, int]:
    auto = [axis for axis, size in sizes.items() if size == -1]
    if len(auto) > 1:
        raise ValueError(f"mesh {source!r}: at most one axis may be -1, got {auto}")
    if any(size == 0 or size < -1 for size in sizes.values()):
        raise ValueError(f"mesh {source!r}: sizes must be positive or -1, got {sizes}")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if auto:
        if num_devices % fixed:
            raise ValueError(
                f"mesh {source!r}: {num_devices} devices are not divisible by the fixed axes' {fixed}"
            )
        sizes = {**sizes, auto[0]: num_devices // fixed}
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(
            f"mesh {source!r}: axis sizes {sizes} multiply to {math.prod(sizes.values())}, "
            f"but {num_devices} devices are visible; use -1 on one axis to take the rest"
        )
    return {axis: sizes[axis] for axis in MESH_AXES}


def make_mesh(spec: str = "dp", devices: list[jax.Device] | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    sizes = parse_mesh_spec(spec, len(devices))
    grid = np.asarray(devices, dtype=object).reshape(tuple(sizes[a] for a in MESH_AXES))
    return Mesh(grid, MESH_AXES)


def logical_to_spec(logical: tuple[str | None, ...]) -> PartitionSpec:
    rules = dict(LOGICAL_AXIS_RULES)
    return PartitionSpec(*(None if name is None else rules[name] for name in logical))


def logical_sharding(mesh: Mesh, logical: tuple[str | None, ...]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical))
