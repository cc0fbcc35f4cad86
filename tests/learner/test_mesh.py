from __future__ import annotations

import ast
from pathlib import Path

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from harnessrl.learner import mesh as mesh_lib
from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.families.dense.decoder import Decoder
from harnessrl.model.sharding import LOGICAL_AXES, logical_to_spec

PACKAGE_DIR = Path(mesh_lib.__file__).resolve().parents[1]
MODEL_DIR = PACKAGE_DIR / "model"
CLOSED_SET = {"batch", "length", "embed", "mlp", "heads", "kv_heads", "head_dim", "vocab", "layers"}
ANNOTATING_CALLS = {"with_partitioning", "_param", "constrain", "logical_to_spec"}
RULES = mesh_lib.LOGICAL_AXIS_RULES


def _logical_names_in_model_sources() -> set[str]:
    names: set[str] = set()
    for path in MODEL_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called not in ANNOTATING_CALLS:
                continue
            for arg in node.args:
                if isinstance(arg, ast.Tuple) and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in arg.elts
                ):
                    names.update(e.value for e in arg.elts)
    return names


def _logical_names_on_params() -> set[str]:
    names: set[str] = set()
    for family in ("llama", "qwen2", "qwen3"):
        model = Decoder(ModelConfig.tiny(family=family), rngs=nnx.Rngs(0))
        state = nnx.state(model, nnx.Param)
        for var in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
            names.update(var.get_metadata()["out_sharding"])
    return names


def _harnessrl_imports(path: Path) -> set[str]:
    """Top-level harnessrl subpackages or modules a source file imports (at any depth)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        found.update(n.split(".")[1] for n in names if n.startswith("harnessrl."))
    return found


def test_model_imports_nothing_above_it_and_learner_only_model():
    """The model names logical axes; the learner owns the mesh and hands the table in."""
    for path in MODEL_DIR.rglob("*.py"):
        assert _harnessrl_imports(path) <= {"model"}, path.name
    # cli: the one config loader (its type checks read the slice recipes); it imports no stage.
    assert _harnessrl_imports(PACKAGE_DIR / "cli.py") == set()
    # kernels: C++ kernels and their build, a leaf that imports no stage.
    for path in (PACKAGE_DIR / "kernels").glob("*.py"):
        assert _harnessrl_imports(path) <= {"kernels"}, path.name
    for path in (PACKAGE_DIR / "learner").glob("*.py"):
        allowed = {"learner", "model", "data", "cli", "kernels"}
        assert _harnessrl_imports(path) <= allowed, path.name


def test_rules_table_has_unique_keys_and_covers_every_model_name():
    keys = [name for name, _ in RULES]
    assert len(keys) == len(set(keys))
    assert set(keys) <= CLOSED_SET
    assert set(LOGICAL_AXES) == CLOSED_SET and set(keys) == set(LOGICAL_AXES)
    in_sources = _logical_names_in_model_sources()
    on_params = _logical_names_on_params()
    assert {"embed", "vocab", "layers", "heads", "mlp"} <= in_sources  # the scan found real code
    assert on_params <= in_sources
    assert in_sources <= set(keys), f"no rule for {in_sources - set(keys)}"
    for _, target in RULES:
        axes = () if target is None else (target,) if isinstance(target, str) else target
        assert set(axes) <= set(mesh_lib.MESH_AXES)


def test_parse_mesh_spec_presets_auto_axis_and_errors():
    assert mesh_lib.parse_mesh_spec("data=2,fsdp=-1", 8) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert mesh_lib.parse_mesh_spec("fsdp_tp", 8) == {"data": 1, "fsdp": 4, "tensor": 2}
    assert mesh_lib.parse_mesh_spec("dp", 1) == {"data": 1, "fsdp": 1, "tensor": 1}
    with pytest.raises(ValueError, match="'pipe=2'"):
        mesh_lib.parse_mesh_spec("pipe=2", 2)
    with pytest.raises(ValueError, match="at most one axis"):
        mesh_lib.parse_mesh_spec("data=-1,fsdp=-1", 4)
    with pytest.raises(ValueError, match="multiply to 4, but 8 devices"):
        mesh_lib.parse_mesh_spec("data=2,fsdp=2", 8)
    with pytest.raises(ValueError, match="not an integer"):
        mesh_lib.parse_mesh_spec("data=two", 2)
    with pytest.raises(ValueError, match="not divisible"):
        mesh_lib.parse_mesh_spec("tensor=3,data=-1", 8)
    with pytest.raises(TypeError, match="string"):
        mesh_lib.parse_mesh_spec(8, 8)  # type: ignore[arg-type]


def test_logical_to_spec_dedupes_axes_and_replicates_indivisible_dims():
    assert logical_to_spec(("batch", "length", "embed"), RULES) == PartitionSpec(
        ("data", "fsdp"), None, None
    )
    assert logical_to_spec(("vocab", "embed"), RULES) == PartitionSpec("tensor", "fsdp")
    devices = [jax.devices()[0]]
    mesh = mesh_lib.make_mesh("dp", devices)
    # Size-1 axes drop out entirely.
    assert logical_to_spec(("vocab", "embed"), RULES, (8, 4), mesh) == PartitionSpec(None, None)
    with pytest.raises(ValueError, match="'experts' has no rule"):
        logical_to_spec(("experts",), RULES)
    # The rows of a training batch follow the table's `batch` rule.
    assert mesh_lib.batch_sharding(mesh).spec == PartitionSpec(("data", "fsdp"), None)


def test_every_slice_recipe_loads_and_is_consistent():
    names = mesh_lib.available_slice_configs()
    expected = {"v5e-8", "v5e-32", "v5p-64", "v6e-16", "v6e-256", "8xH100", "8xH200", "cpu"}
    assert expected <= set(names)
    for name in names:
        cfg = mesh_lib.load_slice_config(name, check_devices=False)
        if cfg.num_devices > 0:
            sizes = mesh_lib.resolve_mesh_sizes(cfg.mesh, cfg.num_devices, name)
            assert sizes["data"] * sizes["fsdp"] * sizes["tensor"] == cfg.num_devices
    assert mesh_lib.load_slice_config("v5p-64", check_devices=False).num_devices == 32


def test_slice_recipe_is_validated_against_visible_devices():
    # The host's CPU devices, present beside any accelerator (which would be JAX's default).
    cpu = jax.devices("cpu")
    cfg = mesh_lib.load_slice_config("cpu", check_devices=False)
    assert cfg.platform == "cpu" and mesh_lib.validate_slice(cfg, cpu)["data"] == len(cpu)
    assert mesh_lib.make_mesh("cpu", cpu).shape["data"] == len(cpu)
    v5e = mesh_lib.load_slice_config("v5e-8", check_devices=False)
    with pytest.raises(ValueError, match=r"platform 'tpu'.*JAX sees \['cpu'\]"):
        mesh_lib.validate_slice(v5e, cpu)
    with pytest.raises(ValueError, match="platform 'gpu'"):
        mesh_lib.make_mesh("8xH100", cpu)
    # Loading checks against the devices JAX sees by default: a recipe for another platform fails.
    visible = jax.devices()[0].platform
    with pytest.raises(ValueError, match=rf"JAX sees \['{visible}'\]"):
        mesh_lib.load_slice_config("cpu" if visible == "tpu" else "v5e-8")
    with pytest.raises(ValueError, match="not found"):
        mesh_lib.load_slice_config("v9z-4")


def test_slice_recipe_rejects_bad_files(tmp_path):
    good = (mesh_lib.TPU_CONFIGS_DIR / "v5e-8.yaml").read_text()
    bad_key = tmp_path / "a.yaml"
    bad_key.write_text(good + "rules: {embed: fsdp}\n")
    with pytest.raises(ValueError, match="unknown keys \\['rules'\\]"):
        mesh_lib.load_slice_config(str(bad_key), check_devices=False)
    bad_rows = tmp_path / "b.yaml"
    bad_rows.write_text(good.replace("[[8, 8192]", "[[4, 8192]"))
    with pytest.raises(ValueError, match="multiples of data\\*fsdp=8"):
        mesh_lib.load_slice_config(str(bad_rows), check_devices=False)
    bad_type = tmp_path / "c.yaml"
    bad_type.write_text(good.replace("hosts: 1", "hosts: one"))
    with pytest.raises(ValueError, match="'hosts' must be int"):
        mesh_lib.load_slice_config(str(bad_type), check_devices=False)


def test_init_distributed_reads_the_environment():
    assert mesh_lib.init_distributed({}) is False
    with pytest.raises(ValueError, match="only \\['JAX_COORDINATOR_ADDRESS'\\] are set"):
        mesh_lib.init_distributed({"JAX_COORDINATOR_ADDRESS": "localhost:1"})
    env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "x"}
    with pytest.raises(ValueError, match="must be integers"):
        mesh_lib.init_distributed(env)
