"""Device mesh and THE logical-axis sharding rules.

In: a mesh spec (`data=2,fsdp=4,tensor=1`, a preset name, or a `tpu_configs/*.yaml` recipe).
Out: a `jax.sharding.Mesh` with axes (data, fsdp, tensor) and the rules that map the model's
logical axis names onto it. Model code names only logical axes (`harnessrl.model.sharding`);
this table, handed in by `use_mesh`, is the one place where they meet hardware.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import jax
import numpy as np
import yaml
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding

from harnessrl.cli import coerce
from harnessrl.model.sharding import logical_to_spec

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")

# (logical axis, mesh axis or axes). Every name in harnessrl.model.sharding.LOGICAL_AXES appears
# exactly once. Size-1 mesh axes make a rule a no-op, so one table serves every preset.
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
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


def logical_axis_rules(zero3: bool = False) -> Rules:
    """THE table, or its ZeRO-3 variant, derived from it: every axis that shards over `fsdp`
    shards over `(data, fsdp)` instead.

    Only parameter axes (`embed`) map to `fsdp` alone, so the variant spreads params, their
    gradients and the optimizer state over all data x fsdp chips; the `batch` rule already uses
    both axes and activations keep their layout (a mesh axis is used once per array).
    """
    if not zero3:
        return LOGICAL_AXIS_RULES
    return tuple(
        (name, ("data", "fsdp") if target == "fsdp" else target)
        for name, target in LOGICAL_AXIS_RULES
    )


# Named shapes for --mesh; -1 takes whatever devices are left.
MESH_PRESETS: dict[str, dict[str, int]] = {
    "dp": {"data": -1, "fsdp": 1, "tensor": 1},
    "fsdp": {"data": 1, "fsdp": -1, "tensor": 1},
    "fsdp_tp": {"data": 1, "fsdp": -1, "tensor": 2},
}

# Slice recipes live beside the package in the source tree; a path always works too.
TPU_CONFIGS_DIR = Path(__file__).resolve().parents[2] / "tpu_configs"
PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class SliceConfig:
    """One hardware target from `tpu_configs/`: topology, mesh shape and the settings that suit it."""

    name: str
    platform: str  # "cpu" | "gpu" | "tpu", as jax.devices()[0].platform reports it
    accelerator: str  # GKE accelerator label (cloud.google.com/gke-tpu-accelerator or gpu) or "cpu"
    device_kind: str  # substring of jax Device.device_kind, "" accepts any
    topology: str
    machine_type: str
    chips_per_host: int  # -1: whatever the host shows (CPU)
    hosts: int
    mesh: dict[str, int]
    buckets: tuple[tuple[int, int], ...]  # (rows, bucket_len) micro-batch shapes
    max_step_tokens: int  # token budget of one optimizer step
    compute_dtype: str
    param_dtype: str
    remat: bool  # recompute each layer's activations in the backward pass
    zero3: bool  # shard params, gradients and optimizer state over data x fsdp, not fsdp alone
    chip_memory_gib: float  # memory of one chip (HBM); 0: unknown (CPU hosts), not checked
    # Named model shapes (harnessrl.learner.plan) this recipe is sized for: they must fit.
    sized_for: tuple[str, ...]

    @property
    def num_devices(self) -> int:
        return -1 if self.chips_per_host < 0 else self.chips_per_host * self.hosts


SLICE_KEYS = frozenset(f.name for f in dataclasses.fields(SliceConfig)) - {"name"}


def parse_mesh_spec(spec: str, num_devices: int) -> dict[str, int]:
    """`"data=2,fsdp=-1"` or a preset name → concrete sizes for every mesh axis."""
    if not isinstance(spec, str):
        raise TypeError(f"mesh spec must be a string, got {type(spec).__name__}: {spec!r}")
    if spec in MESH_PRESETS:
        sizes = dict(MESH_PRESETS[spec])
    else:
        sizes = {axis: 1 for axis in MESH_AXES}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in MESH_AXES:
                raise ValueError(
                    f"mesh spec {spec!r}: expected comma-separated AXIS=SIZE with AXIS in "
                    f"{MESH_AXES}, a preset in {sorted(MESH_PRESETS)}, or a tpu_configs name "
                    f"in {available_slice_configs()}; got {part!r}"
                )
            try:
                sizes[name] = int(value)
            except ValueError as err:
                raise ValueError(f"mesh spec {spec!r}: size of {name!r} is not an integer") from err
    return resolve_mesh_sizes(sizes, num_devices, source=spec)


def resolve_mesh_sizes(
    sizes: Mapping[str, int], num_devices: int, source: str = ""
) -> dict[str, int]:
    unknown = sorted(set(sizes) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh {source!r}: unknown axes {unknown}; axes are {MESH_AXES}")
    sizes = {axis: sizes.get(axis, 1) for axis in MESH_AXES}
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
    return sizes


def available_slice_configs(directory: Path = TPU_CONFIGS_DIR) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.yaml")) if directory.is_dir() else []


def recipe_path(spec: str) -> Path | None:
    """The recipe file a mesh spec names (a `tpu_configs` name or a YAML path), else None."""
    if not spec or spec in MESH_PRESETS or "=" in spec:
        return None
    path = Path(spec)
    if path.suffix in (".yaml", ".yml"):
        return path
    candidate = TPU_CONFIGS_DIR / f"{spec}.yaml"
    return candidate if candidate.is_file() else None


def load_slice_config(name_or_path: str, check_devices: bool = True) -> SliceConfig:
    """Read and type-check one `tpu_configs/*.yaml` recipe, then check it against `jax.devices()`.

    `check_devices=False` reads a recipe for another machine (docs, manifests, tests).
    """
    path = recipe_path(name_or_path)
    if path is None or not path.is_file():
        raise ValueError(
            f"slice config {name_or_path!r} not found; known: {available_slice_configs()} "
            f"or pass a path to a .yaml file"
        )
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"slice config {path}: expected a mapping at top level, got {type(raw)}")
    unknown, missing = sorted(set(raw) - SLICE_KEYS), sorted(SLICE_KEYS - set(raw))
    if unknown:
        raise ValueError(
            f"slice config {path}: unknown keys {unknown}; allowed {sorted(SLICE_KEYS)}"
        )
    if missing:
        raise ValueError(f"slice config {path}: missing keys {missing}")
    hints = typing.get_type_hints(SliceConfig)
    try:  # the config loader's own type check: bad types are ValueErrors naming the key
        values = {key: coerce(repr(key), raw[key], hints[key]) for key in SLICE_KEYS}
    except ValueError as err:
        raise ValueError(f"slice config {path}: {err}") from err
    if values["platform"] not in PLATFORMS:
        raise ValueError(f"slice config {path}: platform {values['platform']!r} not in {PLATFORMS}")
    mesh, buckets = values["mesh"], values["buckets"]
    if set(mesh) != set(MESH_AXES) or not all(type(v) is int for v in mesh.values()):
        raise ValueError(
            f"slice config {path}: mesh must set integer sizes for {MESH_AXES}: {mesh}"
        )
    if not buckets or not all(x > 0 for b in buckets for x in b):
        raise ValueError(
            f"slice config {path}: buckets must be [[rows, bucket_len], ...]: {buckets}"
        )
    cfg = SliceConfig(name=path.stem, **values)
    error = split_error(cfg.buckets, cfg)
    if error:
        raise ValueError(f"slice config {path}: {error}")
    if check_devices:
        validate_slice(cfg, jax.devices())
    return cfg


def split_error(buckets: Sequence[Sequence[int]], cfg: SliceConfig) -> str | None:
    """Why some micro-batch rows cannot be split over the recipe's (data, fsdp) batch shards and
    its processes (one per host, each feeding its own block of rows); None when all can."""
    if cfg.num_devices <= 0:  # whatever the host shows: one process, checked when the mesh is made
        return None
    sizes = resolve_mesh_sizes(cfg.mesh, cfg.num_devices, source=cfg.name)
    shards = sizes["data"] * sizes["fsdp"]
    step = math.lcm(shards, cfg.hosts)
    bad = [list(b) for b in buckets if b[0] % step]
    if not bad:
        return None
    return (
        f"bucket rows must be multiples of data*fsdp={shards} and of its {cfg.hosts} "
        f"process(es), i.e. of {step}: {bad}"
    )


def validate_slice(cfg: SliceConfig, devices: Sequence[jax.Device]) -> dict[str, int]:
    """Check a recipe against the devices JAX sees; return the concrete mesh sizes."""
    platforms = sorted({d.platform for d in devices})
    if platforms != [cfg.platform]:
        raise ValueError(
            f"slice config {cfg.name!r} is for platform {cfg.platform!r}, "
            f"but JAX sees {platforms}; pick the recipe that matches this machine"
        )
    kinds = sorted({d.device_kind for d in devices})
    if cfg.device_kind and not all(_kind_matches(cfg, k) for k in kinds):
        raise ValueError(
            f"slice config {cfg.name!r} expects device kind {cfg.device_kind!r}, JAX sees {kinds}"
        )
    if cfg.num_devices > 0 and cfg.num_devices != len(devices):
        raise ValueError(
            f"slice config {cfg.name!r} describes {cfg.hosts} host(s) x {cfg.chips_per_host} chips "
            f"= {cfg.num_devices} devices, but JAX sees {len(devices)} "
            f"(in {jax.process_count()} process(es)); is jax.distributed initialized on every host?"
        )
    return resolve_mesh_sizes(cfg.mesh, len(devices), source=cfg.name)


def _kind_matches(cfg: SliceConfig, kind: str) -> bool:
    # TPU kinds nest ("TPU v5" is v5p, "TPU v5 lite" is v5e), so they must match exactly;
    # GPU kinds carry memory and form-factor suffixes ("NVIDIA H100 80GB HBM3").
    want, got = cfg.device_kind.lower(), kind.lower()
    return want == got if cfg.platform == "tpu" else want in got


def mesh_sizes(spec: str, devices: Sequence[jax.Device]) -> dict[str, int]:
    """Concrete axis sizes for `spec`: a preset, `AXIS=SIZE,...`, or a tpu_configs name/path."""
    if recipe_path(spec) is not None:
        return validate_slice(load_slice_config(spec, check_devices=False), devices)
    return parse_mesh_spec(spec, len(devices))


def make_mesh(spec: str = "dp", devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    sizes = mesh_sizes(spec, devices)
    shape = tuple(sizes[a] for a in MESH_AXES)
    if devices and devices[0].platform == "tpu":
        # ICI-aware placement so the innermost axes ride the fastest links.
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    else:
        grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES)


def init_distributed(env: Mapping[str, str] | None = None) -> bool:
    """Start `jax.distributed` when the environment describes a multi-process job.

    Reads JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (set by the learner's
    Kubernetes manifests or by hand); on Cloud TPU pod slices `HARNESSRL_DISTRIBUTED=auto` lets
    JAX detect everything itself. Must run before anything touches a JAX device. Returns whether
    it initialized.
    """
    env = os.environ if env is None else env
    if jax.distributed.is_initialized():
        return False
    if env.get("HARNESSRL_DISTRIBUTED") == "auto":
        jax.distributed.initialize()
        return True
    names = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    present = [n for n in names if env.get(n)]
    if not present:
        return False
    if len(present) != len(names):
        raise ValueError(f"multi-process start needs all of {names}; only {present} are set")
    try:
        num, pid = int(env["JAX_NUM_PROCESSES"]), int(env["JAX_PROCESS_ID"])
    except ValueError as err:
        raise ValueError(
            f"JAX_NUM_PROCESSES={env['JAX_NUM_PROCESSES']!r} and JAX_PROCESS_ID="
            f"{env['JAX_PROCESS_ID']!r} must be integers"
        ) from err
    jax.distributed.initialize(env["JAX_COORDINATOR_ADDRESS"], num_processes=num, process_id=pid)
    return True


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> Iterator[None]:
    """Run under `mesh` with THE rules table (or its ZeRO-3 variant) handed to the model."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        yield


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of `[rows, bucket_len]` training arrays: rows by the `batch` rule, over (data, fsdp)."""
    return NamedSharding(mesh, logical_to_spec(("batch", "length"), LOGICAL_AXIS_RULES))
