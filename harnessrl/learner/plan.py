"""Learner stage: the memory planner, bytes per chip of a training run from shapes alone.

In: a model's shape (an HF folder or its config.json, or a named shape) and the run's settings
(a `tpu_configs` recipe, or a train config whose learner.mesh names one). Out: per-chip bytes of
params, optimizer state, gradients and activations, against the chip's memory, and `check_fits`,
the loop's refusal of a run that cannot fit. Nothing is compiled or allocated.

    python -m harnessrl.learner.plan --model qwen3-8b --mesh v5e-32 [--seq-len N --rows N]
        [--remat | --no-remat] [--zero3 | --no-zero3]
    python -m harnessrl.learner.plan --model qwen3-8b --mesh all    (every shipped recipe)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import jax
import yaml
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from harnessrl.learner.config import LearnerConfig
from harnessrl.learner.mesh import (
    MESH_AXES,
    TPU_CONFIGS_DIR,
    Rules,
    SliceConfig,
    available_slice_configs,
    load_slice_config,
    logical_axis_rules,
    recipe_path,
    resolve_mesh_sizes,
)
from harnessrl.model import registry
from harnessrl.model.sharding import logical_to_spec

AnyConfig = Any  # a model family's config (`harnessrl.model.registry`)
GIB = 2**30
BYTES = {"float32": 4, "bfloat16": 2}
NAMED_SHAPES = tuple(registry.PLANNED_SHAPES)


def model_shape(spec: str) -> AnyConfig:
    """A decoder's shape without its weights: a named shape (`NAMED_SHAPES`), an HF model folder,
    or its `config.json` (of any family in `harnessrl.model.registry`)."""
    if spec in registry.PLANNED_SHAPES:
        return registry.PLANNED_SHAPES[spec]()
    path = Path(spec)
    config = path / "config.json" if path.is_dir() else path
    if config.name.endswith(".json") and config.is_file():
        return registry.config_from_hf(json.loads(config.read_text()))
    raise ValueError(
        f"--model {spec!r} is neither a named shape ({', '.join(NAMED_SHAPES)}), an HF model "
        "folder with a config.json, nor a config.json file"
    )


@dataclasses.dataclass(frozen=True)
class Layout:
    """Mesh axis sizes and the rules the learner would shard with (`logical_axis_rules`)."""

    sizes: dict[str, int]
    rules: Rules

    @property
    def mesh(self) -> Mesh:
        # Shapes only: logical_to_spec reads nothing of a mesh but its axis sizes, which an
        # AbstractMesh has without any device (the planner runs before jax.distributed starts).
        return cast(Mesh, AbstractMesh(tuple(self.sizes[a] for a in MESH_AXES), MESH_AXES))

    def shards(self, logical: Sequence[str | None], shape: Sequence[int]) -> int:
        """How many pieces the learner's own rule→PartitionSpec code cuts an array into."""
        spec = logical_to_spec(logical, self.rules, shape, self.mesh)
        axes = [
            a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)
        ]
        return math.prod(self.sizes[a] for a in axes)

    def per_chip(self, name: str, size: int) -> int:
        """One logical dimension's share on a chip (a dimension the rules cannot split stays whole)."""
        return size // self.shards((name,), (size,))


@functools.cache
def param_leaves(cfg: AnyConfig) -> tuple[tuple[tuple[int, ...], tuple[str | None, ...]], ...]:
    """(shape, logical axes) of every param, from the real decoder built abstractly."""
    decoder = registry.of(cfg).decoder
    abstract = nnx.eval_shape(lambda: decoder(cfg, rngs=nnx.Rngs(0)))
    variables = jax.tree.leaves(
        nnx.state(abstract, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return tuple(
        (tuple(v.shape), tuple(v.get_metadata().get("out_sharding") or ())) for v in variables
    )


def activation_bytes(
    cfg: AnyConfig, layout: Layout, rows: int, length: int, remat: bool, compute_dtype: str
) -> int:
    """Peak activation bytes per chip of one micro-step of `rows x length` tokens.

    Per chip: b = rows / (data x fsdp) rows (the `batch` rule), t = length, and the tensor
    shares h, k, f, V of heads, kv heads, mlp and vocab; c = compute dtype bytes, e = head_dim,
    d = hidden. What the backward pass keeps of each layer kind i (`layer_kinds`) is A_i; while
    one layer runs backward it adds B_i (the cotangents of its largest intermediates) plus its
    weights gathered in compute dtype and their unreduced float32 gradient (W). The head and
    loss hold G = b t V (12 + c) (float32 logits, the loss's exp and the logits' gradient, and
    that gradient in compute dtype) plus the gathered head. Shared by all layers: the mask
    (b t^2 bytes) and RoPE tables (2 b t e 4). With L layers in all:

        remat:    L b t d c + max_i (A_i + B_i) + W  (one layer rebuilt at a time), or G if larger
        no remat: sum_i (A_i + A'_i) + max(max_i B_i + W, G)

    tests/learner/test_plan.py holds this against XLA's compiled memory analysis of small
    decoders on CPU.
    """
    c = BYTES[compute_dtype]
    b = rows // layout.shards(("batch",), (rows,))
    t, d = length, cfg.hidden_size
    v = layout.per_chip("vocab", cfg.vocab_size)
    kinds = layer_kinds(cfg, layout, b, t, c)
    weights = per_chip_layer_weights(cfg, layout) * (c + 4)
    head = b * t * v * (12 + c) + d * v * c
    shared = b * t * t + 2 * b * t * cfg.head_dim * 4
    if remat:
        rebuilt = max(kept + backward for _, kept, _, backward in kinds) + weights
        return shared + cfg.num_layers * b * t * d * c + max(rebuilt, head)
    kept = sum(count * (kept + extra) for count, kept, extra, _ in kinds)
    return shared + kept + max(max(backward for *_, backward in kinds) + weights, head)


def layer_kinds(
    cfg: AnyConfig, layout: Layout, b: int, t: int, c: int
) -> list[tuple[int, int, int, int]]:
    """(count, A, A', B) per layer kind, in bytes per chip (see `activation_bytes`); A' is what
    a fully kept forward holds besides A (the masked scores in float32). Each family counts its
    own layers (`harnessrl.model.memory` and the family's `memory.py`)."""
    return registry.of(cfg).layer_kinds(cfg, layout.per_chip, b, t, c)


def per_chip_layer_weights(cfg: AnyConfig, layout: Layout) -> int:
    """Elements of one layer's weights (one of each kind) on a chip once FSDP has gathered them
    (tensor stays split)."""
    gathered = dataclasses.replace(
        layout, rules=tuple((n, None if n == "embed" else a) for n, a in layout.rules)
    )
    total = 0
    for shape, names in param_leaves(cfg):
        if names and names[0] == "layers":
            total += math.prod(shape[1:]) // gathered.shards(names[1:], shape[1:])
    return total


@dataclasses.dataclass(frozen=True)
class Plan:
    """Bytes per chip of one run; `total` is the peak the run needs."""

    model: str
    mesh: str
    sizes: dict[str, int]
    zero3: bool
    remat: bool
    bucket: tuple[int, int]  # the micro-batch shape with the largest activations
    param_count: int  # elements of all params, unsharded
    params: int
    optimizer: int  # AdamW's first (float32) and second (param dtype) moments
    accumulator: int  # the float32 gradient accumulator the micro-steps add into
    gradient: int  # one micro-step's gradient, before it is added (param dtype)
    reference: int  # the frozen reference policy's params when kl_coef > 0
    load: int  # the largest param's shard, in transit from the host while the model loads
    activations_remat: int
    activations_no_remat: int
    chip_bytes: int  # 0: unknown

    @property
    def activations(self) -> int:
        return self.activations_remat if self.remat else self.activations_no_remat

    @property
    def load_peak(self) -> int:
        """Loading straight into shards: the params placed so far and the one arriving."""
        return self.params + self.load

    @property
    def total(self) -> int:
        state = self.params + self.optimizer + self.accumulator + self.reference
        # The apply program holds one float32 update per param instead of the micro-step's
        # gradient and activations.
        return max(state + max(self.gradient + self.activations, self.accumulator), self.load_peak)

    @property
    def fits(self) -> bool | None:
        return None if not self.chip_bytes else self.total <= self.chip_bytes


def plan_run(
    model: AnyConfig,
    learner: LearnerConfig,
    buckets: Sequence[Sequence[int]],
    recipe: SliceConfig,
    model_name: str = "",
    devices: int | None = None,
) -> Plan:
    """The per-chip plan of training `model` with `learner` settings on `recipe`'s mesh."""
    count = recipe.num_devices if recipe.num_devices > 0 else (devices or 1)
    sizes = resolve_mesh_sizes(recipe.mesh, count, source=recipe.name)
    layout = Layout(sizes, logical_axis_rules(learner.zero3))
    p = BYTES[learner.param_dtype]
    shards = [
        math.prod(shape) // layout.shards(names or (None,) * len(shape), shape)
        for shape, names in param_leaves(model)
    ]
    elements = sum(shards)
    acts = {
        remat: [
            (activation_bytes(model, layout, r, t, remat, learner.compute_dtype), (r, t))
            for r, t in buckets
        ]
        for remat in (True, False)
    }
    peak_remat, peak_plain = max(acts[True]), max(acts[False])
    chip = recipe.chip_memory_gib * GIB if recipe.chip_memory_gib else 0
    if recipe.platform == "cpu":  # CPU devices share the host's memory
        chip = host_memory() // count
    return Plan(
        model=model_name,
        mesh=recipe.name,
        sizes=sizes,
        zero3=learner.zero3,
        remat=learner.remat,
        bucket=(peak_remat if learner.remat else peak_plain)[1],
        param_count=sum(math.prod(shape) for shape, _ in param_leaves(model)),
        params=elements * p,
        optimizer=elements * (4 + p),
        accumulator=elements * 4,
        gradient=elements * p,
        reference=elements * p if learner.kl_coef else 0,
        load=max(shards) * p,
        activations_remat=peak_remat[0],
        activations_no_remat=peak_plain[0],
        chip_bytes=int(chip),
    )


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def recipe_learner(recipe: SliceConfig, base: LearnerConfig, **keys: Any) -> LearnerConfig:
    """`base` with the recipe's numerics applied beneath `keys`, as `--mesh RECIPE` does."""
    from_recipe = dict(
        compute_dtype=recipe.compute_dtype,
        param_dtype=recipe.param_dtype,
        remat=recipe.remat,
        zero3=recipe.zero3,
    )
    return base.replace(**{**from_recipe, **keys})


def run_settings(spec: str) -> tuple[LearnerConfig, tuple[tuple[int, int], ...], SliceConfig]:
    """Learner settings, buckets and hardware of `--mesh SPEC`: a `tpu_configs` recipe (name or
    path), or a train config whose `learner.mesh` names one (its learner keys and `data.buckets`
    win over the recipe's, as in `python -m harnessrl.train --config FILE`)."""
    path = recipe_path(spec)
    if path is None:
        raise ValueError(
            f"--mesh {spec!r}: the planner needs chip memory, so a tpu_configs recipe (name or "
            "path) or a train config YAML whose learner.mesh names one"
        )
    doc = yaml.safe_load(path.read_text()) if path.is_file() else None
    if not isinstance(doc, dict) or "learner" not in doc:  # a tpu_configs recipe itself
        recipe = load_slice_config(spec, check_devices=False)
        return recipe_learner(recipe, LearnerConfig(mesh=spec)), recipe.buckets, recipe
    keys = dict(doc.get("learner") or {})
    mesh = str(keys.get("mesh", ""))
    if recipe_path(mesh) is None:
        raise ValueError(f"{path}: learner.mesh={mesh!r} names no tpu_configs recipe")
    recipe = load_slice_config(mesh, check_devices=False)
    learner = recipe_learner(recipe, LearnerConfig(), **keys)
    data = doc.get("data") or {}
    buckets = tuple((int(r), int(t)) for r, t in data.get("buckets", recipe.buckets))
    return learner, buckets, recipe


def advice(
    model: AnyConfig,
    learner: LearnerConfig,
    buckets: Sequence[Sequence[int]],
    recipe: SliceConfig,
    plan: Plan,
) -> list[str]:
    """What to change so that the run fits, cheapest first; each change is planned, not guessed."""

    def fits(lr: LearnerConfig = learner, bs: Sequence[Sequence[int]] = buckets) -> bool:
        return bool(plan_run(model, lr, bs, recipe).fits)

    out = []
    if not learner.zero3 and plan.sizes["data"] > 1 and fits(learner.replace(zero3=True)):
        out.append(
            f"enable ZeRO-3: zero3: true in the recipe {recipe.name} (or learner.zero3=true) "
            f"shards the state over data x fsdp = {plan.sizes['data'] * plan.sizes['fsdp']} chips"
        )
    if not learner.remat and fits(learner.replace(remat=True)):
        out.append("recompute activations: learner.remat=true")
    rows, length = plan.bucket
    shorter = length // 2
    while shorter >= 128 and not fits(bs=[(r, min(t, shorter)) for r, t in buckets]):
        shorter //= 2
    if shorter >= 128:
        out.append(
            f"shorter micro-batch rows: data.buckets with at most {shorter} tokens per row "
            f"(the largest, {[rows, length]}, needs {plan.activations / GIB:.1f} GiB of "
            "activations per chip)"
        )
    if learner.param_dtype == "float32" and fits(learner.replace(param_dtype="bfloat16")):
        out.append("bfloat16 params: learner.param_dtype=bfloat16")
    state = plan.params + plan.optimizer + plan.accumulator + plan.gradient + plan.reference
    whole = state * plan.param_count // max(1, plan.params // BYTES[learner.param_dtype])
    out.append(
        f"a larger slice: params, optimizer state and gradients are {state / GIB:.1f} GiB per "
        f"chip here, {whole / GIB:.0f} GiB unsharded, before activations"
    )
    return out


def check_fits(
    model_spec: str, learner: LearnerConfig, buckets: Sequence[Sequence[int]]
) -> Plan | None:
    """Raise a ValueError naming what to change when the run cannot fit its recipe's chips.

    Runs only for a `tpu_configs` recipe with a known chip memory and a model whose shape can be
    read without its weights; returns the plan it checked, or None when it checked nothing.
    """
    if recipe_path(learner.mesh) is None:
        return None
    recipe = load_slice_config(learner.mesh, check_devices=False)
    if not recipe.chip_memory_gib:
        return None
    try:
        model = model_shape(model_spec)
    except ValueError:
        return None  # loading the model reports what is wrong with the spec
    plan = plan_run(model, learner, buckets, recipe, model_name=model_spec)
    if plan.fits:
        return plan
    changes = "; or ".join(advice(model, learner, buckets, recipe, plan))
    raise ValueError(
        f"model {model_spec!r} does not fit learner.mesh={learner.mesh}: it needs "
        f"{plan.total / GIB:.1f} GiB per chip of {recipe.chip_memory_gib:g} GiB (params "
        f"{plan.params / GIB:.1f}, optimizer {plan.optimizer / GIB:.1f}, gradients "
        f"{(plan.accumulator + plan.gradient) / GIB:.1f}, activations {plan.activations / GIB:.1f} "
        f"at micro-batch {list(plan.bucket)}). To fit: {changes}. "
        f"`python -m harnessrl.learner.plan --model MODEL --mesh {learner.mesh}` prints the table"
    )


def table(plan: Plan) -> str:
    """The plan as a text table, in GiB per chip."""
    mesh = ",".join(f"{a}={n}" for a, n in plan.sizes.items())
    rows = [
        ("params", plan.params),
        ("optimizer state (AdamW moments)", plan.optimizer),
        ("gradient accumulator (float32)", plan.accumulator),
        ("gradient of a micro-step", plan.gradient),
        ("reference policy (kl_coef > 0)", plan.reference),
        ("load (params + largest shard)", plan.load_peak),
        ("activations with remat", plan.activations_remat),
        ("activations without remat", plan.activations_no_remat),
        (f"total (remat={'on' if plan.remat else 'off'})", plan.total),
        ("chip memory", plan.chip_bytes),
    ]
    head = (
        f"{plan.model} on {plan.mesh} ({mesh}, zero3={'on' if plan.zero3 else 'off'}), "
        f"largest micro-batch {list(plan.bucket)}, GiB per chip:"
    )
    return "\n".join([head, *(f"  {name:<34} {value / GIB:8.2f}" for name, value in rows)])


@dataclasses.dataclass(frozen=True)
class PlanArgs:
    """`python -m harnessrl.learner.plan`: bytes per chip of a run, from shapes alone."""

    model: str = (
        ""  # a named shape (NAMED_SHAPES: qwen3-8b, smollm2, ...), an HF folder or config.json
    )
    mesh: str = "cpu"  # a tpu_configs recipe (name or path), a train config YAML, or all
    seq_len: int | None = None  # plan one micro-batch of this row length instead of the buckets
    rows: int | None = None  # rows of that micro-batch (default: one per data x fsdp shard)
    remat: bool | None = None  # override the recipe's remat for the total
    zero3: bool | None = None  # override the recipe's zero3


def shipped() -> list[str]:
    """Every recipe in the source tree: the `tpu_configs` names, then the `recipes/` train configs."""
    trains = sorted((TPU_CONFIGS_DIR.parent / "recipes").glob("*.yaml"))
    return [
        *available_slice_configs(),
        *(str(p.relative_to(TPU_CONFIGS_DIR.parent)) for p in trains),
    ]


def summary(plans: Sequence[tuple[str, Plan]]) -> str:
    """One markdown row per recipe, in GiB per chip."""
    head = (
        "| recipe | mesh (data, fsdp, tensor) | zero3 | largest micro-batch | params + optimizer "
        "+ gradients | activations remat / none | total | chip | fits |"
    )
    lines = [head, "|" + "---|" * 9]
    for name, p in plans:
        state = p.params + p.optimizer + p.accumulator + p.gradient + p.reference
        fits = {True: "yes", False: "no", None: "?"}[p.fits]
        lines.append(
            f"| {name} | {p.sizes['data']}, {p.sizes['fsdp']}, {p.sizes['tensor']} | "
            f"{'on' if p.zero3 else 'off'} | {p.bucket[0]} x {p.bucket[1]} | {state / GIB:.1f} | "
            f"{p.activations_remat / GIB:.1f} / {p.activations_no_remat / GIB:.1f} | "
            f"{p.total / GIB:.1f} | {p.chip_bytes / GIB:.0f} | {fits} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from harnessrl.cli import command_line

    prog = "python -m harnessrl.learner.plan"
    # `--remat` / `--no-remat` (and zero3's) read as `--remat=true` / `--remat=false`.
    flags = {
        f"--{prefix}{key}": f"--{key}={value}"
        for key in ("remat", "zero3")
        for prefix, value in (("", "true"), ("no-", "false"))
    }
    args = [flags.get(a, a) for a in argv or ()]
    cli: PlanArgs = command_line(
        PlanArgs(), args, prog=prog, doc=__doc__ or "", required=("model",)
    )
    model = model_shape(cli.model)
    specs = shipped() if cli.mesh == "all" else [cli.mesh]
    plans = [(spec, *plan_cli(model, cli, spec)) for spec in specs]
    if cli.mesh == "all":
        print(summary([(spec, plan) for spec, plan, _ in plans]))
    else:
        _, plan, changes = plans[0]
        print(table(plan))
        if changes:
            print("to fit: " + "; or ".join(changes))
    for spec, plan, _ in plans:
        fits = {True: "yes", False: "no", None: "unknown"}[plan.fits]
        print(
            f"plan: model={cli.model} mesh={spec} per_chip_gib={plan.total / GIB:.2f} fits={fits}"
        )
    return 0


def plan_cli(model: AnyConfig, cli: PlanArgs, spec: str) -> tuple[Plan, list[str]]:
    """One recipe's plan with the command line's overrides, and what to change if it cannot fit."""
    learner, buckets, recipe = run_settings(spec)
    changes = {k: getattr(cli, k) for k in ("remat", "zero3") if getattr(cli, k) is not None}
    learner = learner.replace(**changes)
    devices = jax.device_count() if recipe.num_devices <= 0 else None
    if cli.seq_len is not None or cli.rows is not None:
        count = recipe.num_devices if devices is None else devices
        sizes = resolve_mesh_sizes(recipe.mesh, count, source=recipe.name)
        rows = cli.rows or sizes["data"] * sizes["fsdp"]
        buckets = ((rows, cli.seq_len or max(t for _, t in buckets)),)
    plan = plan_run(model, learner, buckets, recipe, model_name=cli.model, devices=devices)
    if plan.fits is not False or cli.mesh == "all":
        return plan, []
    return plan, advice(model, learner, buckets, recipe, plan)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
