"""The train config loader: YAML + overrides → frozen stage configs; recipes; bad keys rejected."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harnessrl.cli import get, leaves, render, resolve
from harnessrl.config import HELP, TrainConfig, load_config, parse_args, reference
from harnessrl.learner.mesh import TPU_CONFIGS_DIR, available_slice_configs
from harnessrl.pods.k8s import KubernetesCodingConfig, KubernetesLauncherConfig
from harnessrl.rollout.local import LocalLauncherConfig
from proxy_sidecar.config import SidecarConfig
from proxy_sidecar.inject.webhook import SidecarSpec

ROOT = Path(__file__).resolve().parents[1]
PROG = "python -m harnessrl.train"


def test_defaults_are_the_embedded_run() -> None:
    cfg = load_config()
    assert cfg == TrainConfig()
    assert cfg.serve.model == "smollm2" and cfg.rollout.launcher == "local"
    assert cfg.rollout.tasks == "builtin:addition" and cfg.serve.port == 0
    assert cfg.sidecar.port == 0 and cfg.sidecar.log_calls is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run.steps = 3  # type: ignore[misc]


def test_each_stage_config_is_the_section_itself() -> None:
    """The sidecar section is the sidecar's own config; the launchers' nest under rollout."""
    cfg = TrainConfig()
    assert type(cfg.sidecar) is SidecarConfig
    assert type(cfg.rollout.local) is LocalLauncherConfig
    assert type(cfg.rollout.kubernetes) is KubernetesLauncherConfig
    for section in (SidecarConfig, KubernetesLauncherConfig):
        assert len(dataclasses.fields(section)) <= 26  # the style budget is about 25 fields a stage


def test_overrides_are_typed_and_layered(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        "run:\n  steps: 5\n  out_dir: runs/x\nlearner:\n  learning_rate: 3.0e-6\n"
        "data:\n  buckets: [[4, 128], [2, 256]]\ngroup_size: 4\n"
        "rollout:\n  kubernetes:\n    namespace: team-a\n    sidecar: {cpu: 500m}\n"
    )
    cfg = load_config(
        f,
        [
            "steps=7",
            "--learner.learning_rate=2e-5",
            "--mesh=fsdp",
            "serve.prefill_buckets=[16, 64]",
            "run.display=false",
            "data.step_token_budget=none",
            "learner.checkpoint_dir=null",
        ],
    )
    assert cfg.run.steps == 7 and cfg.run.out_dir == "runs/x"  # CLI beats file beats defaults
    assert cfg.learner.learning_rate == 2e-5 and cfg.learner.mesh == "fsdp"
    assert cfg.data.buckets == ((4, 128), (2, 256)) and cfg.serve.prefill_buckets == (16, 64)
    assert cfg.rollout.group_size == 4 and cfg.run.display is False
    assert cfg.data.step_token_budget is None and cfg.learner.checkpoint_dir is None
    assert cfg.rollout.kubernetes.namespace == "team-a"
    assert cfg.rollout.kubernetes.sidecar.cpu == "500m"


def test_every_launcher_and_sidecar_field_is_settable() -> None:
    cfg = load_config(
        overrides=[
            "rollout.kubernetes.service_account=runner",
            "kubernetes.ttl_s=30",  # a dotted tail names the one field that ends with it
            "namespace=team-b",  # so does a bare key that exactly one section has
            "rollout.kubernetes.sidecar.store_secret=my-store",
            "rollout.kubernetes.command=python -m agent {task_file}",
            "rollout.local.kill_grace_s=0.5",
            "sidecar.read_timeout_s=42",
            "sidecar.train_overrides={temperature: 1.0}",
            "sidecar.retries=0",
            "sidecar.fsync=true",
        ]
    )
    k8s = cfg.rollout.kubernetes
    assert (k8s.service_account, k8s.ttl_s, k8s.namespace) == ("runner", 30, "team-b")
    assert k8s.sidecar.store_secret == "my-store"
    assert k8s.command == ("python", "-m", "agent", "{task_file}")
    assert cfg.rollout.local.kill_grace_s == 0.5
    assert cfg.sidecar.read_timeout_s == 42.0 and cfg.sidecar.train_overrides == {
        "temperature": 1.0
    }
    assert cfg.sidecar.retries == 0 and cfg.sidecar.fsync is True
    names = {
        "sidecar": SidecarConfig,
        "rollout.kubernetes": KubernetesLauncherConfig,
        "rollout.kubernetes.sidecar": SidecarSpec,
        "rollout.kubernetes.coding": KubernetesCodingConfig,
        "rollout.local": LocalLauncherConfig,
    }
    every = {f"{p}.{f.name}" for p, c in names.items() for f in dataclasses.fields(c)}
    assert every - {"rollout.kubernetes.sidecar", "rollout.kubernetes.coding"} <= set(
        leaves(TrainConfig)
    )


def test_the_loop_sets_the_wiring_itself() -> None:
    with pytest.raises(
        ValueError, match=r"sidecar\.store is set by the train loop from rollout\.store"
    ):
        load_config(overrides=["sidecar.store=sqlite:///elsewhere.db"])
    with pytest.raises(ValueError, match=r"sidecar\.upstreams is set by the train loop"):
        load_config(overrides=["sidecar.upstreams=http://x:1"])
    with pytest.raises(ValueError, match=r"sidecar\.upstream is set by the train loop"):
        load_config(overrides=["rollout.kubernetes.sidecar.upstream=http://x:1"])


def test_seed_alias_sets_every_seed() -> None:
    cfg = load_config(overrides=["seed=5"])
    assert cfg.run.seed == cfg.serve.seed == 5


def test_smoke_preset_and_overrides_on_top() -> None:
    cfg = load_config(overrides=["steps=3"], smoke=True)
    assert cfg.serve.model == "tiny" and cfg.learner.mesh == "data=2" and cfg.run.steps == 3
    assert cfg.rollout.local.concurrency == cfg.rollout.kubernetes.concurrency == 4


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("stepz=3", "unknown config key 'stepz'"),
        ("run.stepz=3", "unknown config key 'run.stepz'"),
        ("runn.steps=3", "unknown config section 'runn'"),
        ("rollout.kubernetes.nam=x", r"section 'rollout\.kubernetes' has \[.*'namespace'"),
        ("steps=three", "run.steps must be int, got 'three'"),
        ("steps=1.5", "run.steps must be int"),
        ("run.display=maybe", "run.display must be bool"),
        ("learner.learning_rate=fast", "learner.learning_rate must be float"),
        ("data.buckets=[[4, 128, 3]]", r"data.buckets\[0\] must have 2 items"),
        ("data.buckets=12", "data.buckets must be a list"),
        ("port=1", "ambiguous"),
        ("concurrency=1", r"ambiguous; write one of \['rollout.local.concurrency', 'rollout.kube"),
        ("steps", "must look like key=value"),
        ("run.loop=sometimes", "run.loop must be one of"),
        ("learner.learning_rate=-1", r"learner\.learning_rate=-1\.0 must be a positive number"),
        ("rollout.group_size=0", "rollout.group_size must be an integer >= 1"),
        ("rollout.posted_reward=sometimes", "rollout.posted_reward must be one of"),
        ("sidecar.pause_timeout_s=0", r"^sidecar\.pause_timeout_s must be > 0, got 0\.0"),
        ("sidecar.mode=play", r"^sidecar\.mode must be one of"),
        ("rollout.kubernetes.namespace=Bad_NS", "namespace is not a DNS label"),
        ("rollout.kubernetes.sidecar.port=0", "SidecarSpec.port must be an int in 1..65535"),
        ("rollout.local.concurrency=0", "LocalLauncherConfig.concurrency must be >= 1"),
        ("sidecar.train_overrides=[1]", "sidecar.train_overrides must be a mapping"),
        ("--mesh=v9z-4.yaml", "learner.mesh='v9z-4.yaml': slice config 'v9z-4.yaml' not found"),
    ],
)
def test_bad_overrides_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(overrides=[override])


def test_bad_yaml_values_are_rejected(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("run:\n  steps: '3'\n")  # a string where an int belongs is parsed, like the CLI
    assert load_config(f).run.steps == 3
    f.write_text("run:\n  steps: true\n")
    with pytest.raises(ValueError, match=r"run\.steps must be int, got bool"):
        load_config(f)
    f.write_text("run:\n  bogus: 1\n")
    with pytest.raises(ValueError, match=r"unknown config key 'run\.bogus'"):
        load_config(f)
    f.write_text("rollout:\n  concurrency: 4\n")  # a key that moved into a launcher section
    with pytest.raises(ValueError, match=r"unknown config key 'rollout\.concurrency'"):
        load_config(f)
    f.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_config(f)
    f.write_text("run: [steps\n")
    with pytest.raises(ValueError, match="not YAML"):
        load_config(f)
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_command_line_forms(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("run:\n  steps: 5\n  eval_every: 2\n")
    cfg = parse_args(
        ["--config", str(f), "--steps", "9", "--run.display", "--mesh", "fsdp", "--smoke"],
        PROG,
        "",
    )
    assert (cfg.run.steps, cfg.run.eval_every, cfg.run.display) == (9, 2, True)
    assert cfg.learner.mesh == "fsdp" and cfg.serve.model == "tiny"
    assert parse_args(["--smoke", "false", "run.display=false"], PROG, "").serve.model == "smollm2"
    with pytest.raises(SystemExit) as exc:
        parse_args(["--steps"], PROG, "")
    assert exc.value.code == 2
    assert "--steps needs a value" in capsys.readouterr().err


def test_help_lists_every_key_with_a_meaning(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help"], PROG, "the loop")
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "--smoke" in text and "--config FILE.yaml" in text and "--mesh SPEC" in text
    lines = text.splitlines()
    for key in leaves(TrainConfig):
        line = next((ln for ln in lines if ln.strip().startswith(f"{key}=")), None)
        assert line is not None, f"--help does not list {key}"
        kind, _, meaning = line.partition(")  ")
        assert "(" in kind and meaning.strip(), f"{key} has no type or description in --help"
        assert resolve(TrainConfig, key) == (key,)
    assert "  rollout.kubernetes.sidecar.upstream=" in text and HELP["sidecar.store"] in text


def test_docs_reference_is_generated_from_the_code() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    begin, end = "<!-- generated: python -m harnessrl.config -->\n", "<!-- end generated -->"
    assert begin in doc and end in doc
    generated = doc.split(begin, 1)[1].split(end, 1)[0]
    assert generated.strip() == reference().strip(), (
        "docs/configuration.md is stale: paste the output of `python -m harnessrl.config` "
        "between its generated markers"
    )
    for key in leaves(TrainConfig):
        assert f"`{key}`" in generated, f"docs/configuration.md misses {key}"


def test_config_module_prints_the_reference() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "harnessrl.config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert out == reference()


def test_every_value_round_trips_through_overrides() -> None:
    cfg = load_config(overrides=["steps=4", "data.buckets=[[2, 128]]", "namespace=ns-1"])
    flat = {key: get(cfg, key) for key in leaves(TrainConfig)}
    assert load_config(overrides=flat) == cfg
    # As command-line text, the way the loop hands its sidecar every field.
    assert load_config(overrides=[f"--{key}={render(value)}" for key, value in flat.items()]) == cfg


@pytest.mark.parametrize("name", available_slice_configs())
def test_every_recipe_is_a_full_preset(name: str) -> None:
    raw = yaml.safe_load((TPU_CONFIGS_DIR / f"{name}.yaml").read_text())
    for how in (
        ["--mesh", name],
        [f"learner.mesh={name}"],
        ["--config", str(TPU_CONFIGS_DIR / f"{name}.yaml")],
    ):
        cfg = parse_args(how, PROG, "")
        assert re.fullmatch(rf"(.*/)?{re.escape(name)}(\.yaml)?", cfg.learner.mesh)
        assert cfg.data.buckets == tuple(tuple(b) for b in raw["buckets"])
        assert cfg.data.step_token_budget == raw["max_step_tokens"]
        assert cfg.learner.compute_dtype == raw["compute_dtype"]
        assert cfg.learner.param_dtype == raw["param_dtype"]
        assert cfg.learner.remat is raw["remat"]
        assert cfg.learner.zero3 is raw["zero3"]
        # Everything else stays the embedded defaults.
        assert cfg.run == TrainConfig().run and cfg.serve == TrainConfig().serve


def test_v5e_32_alone_yields_its_recipe_and_the_user_wins() -> None:
    cfg = parse_args(["--mesh", "v5e-32"], PROG, "")
    assert cfg.data.buckets == ((32, 3072), (64, 1536), (128, 768))
    assert (cfg.learner.compute_dtype, cfg.learner.param_dtype) == ("bfloat16", "float32")
    assert cfg.learner.remat is True and cfg.data.step_token_budget == 4194304
    mine = parse_args(
        ["learner.remat=false", "--mesh", "v5e-32", "data.buckets=[[32, 1024]]", "--smoke"],
        PROG,
        "",
    )
    assert mine.learner.remat is False and mine.data.buckets == ((32, 1024),)
    assert mine.learner.compute_dtype == "bfloat16" and mine.serve.model == "tiny"


def test_a_bad_recipe_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "mine.yaml"
    text = (TPU_CONFIGS_DIR / "v5e-8.yaml").read_text()
    bad.write_text(text.replace("remat: true", "remat: full"))
    with pytest.raises(ValueError, match=r"mine\.yaml: 'remat' must be bool, got 'full'"):
        load_config(overrides=[f"--mesh={bad}"])
    bad.write_text(text.replace("compute_dtype: bfloat16", "compute_dtype: float16"))
    with pytest.raises(ValueError, match="compute_dtype='float16' must be one of"):
        load_config(bad)
