"""The one config loader: YAML + overrides → frozen stage configs; bad keys and types rejected."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from harnessrl.config import SECTIONS, TrainConfig, as_dict, describe, load_config, resolve_key


def test_defaults_are_the_embedded_run() -> None:
    cfg = load_config()
    assert cfg == TrainConfig()
    assert cfg.serve.model == "smollm2" and cfg.rollout.launcher == "local"
    assert cfg.rollout.tasks == "builtin:addition" and cfg.serve.port == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run.steps = 3  # type: ignore[misc]


def test_overrides_are_typed_and_layered(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        "run:\n  steps: 5\n  out_dir: runs/x\nlearner:\n  learning_rate: 3.0e-6\n"
        "data:\n  buckets: [[4, 128], [2, 256]]\ngroup_size: 4\n"
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


def test_seed_alias_sets_every_seed() -> None:
    cfg = load_config(overrides=["seed=5"])
    assert cfg.run.seed == cfg.serve.seed == cfg.learner.seed == 5


def test_smoke_preset_and_overrides_on_top() -> None:
    cfg = load_config(overrides=["steps=3"], smoke=True)
    assert cfg.serve.model == "tiny" and cfg.learner.mesh == "data=2" and cfg.run.steps == 3


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("stepz=3", "unknown config key 'stepz'"),
        ("run.stepz=3", "unknown config key 'run.stepz'"),
        ("runn.steps=3", "unknown config section 'runn'"),
        ("steps=three", "run.steps must be int, got 'three'"),
        ("steps=1.5", "run.steps must be int"),
        ("run.display=maybe", "run.display must be bool"),
        ("learner.learning_rate=fast", "learner.learning_rate must be float"),
        ("data.buckets=[[4, 128, 3]]", r"data.buckets\[0\] must have 2 items"),
        ("data.buckets=12", "data.buckets must be a list"),
        ("port=1", "ambiguous"),
        ("steps", "must look like key=value"),
        ("run.loop=sometimes", "run.loop must be one of"),
        ("learner.learning_rate=-1", "learning_rate"),
        ("rollout.group_size=0", "rollout.group_size must be an integer >= 1"),
        ("rollout.posted_reward=sometimes", "rollout.posted_reward must be one of"),
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
    f.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_config(f)
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_every_option_is_documented() -> None:
    text = describe()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            line = next(
                ln for ln in text.splitlines() if ln.strip().startswith(f"{section}.{f.name}=")
            )
            meaning = line.split(")  ", 1)[1].strip() if ")  " in line else ""
            assert meaning, f"{section}.{f.name} has no description in --help"
            assert resolve_key(f"{section}.{f.name}") == (section, f.name)


def test_docs_reference_lists_every_key() -> None:
    doc = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"`{section}.{f.name}`" in doc, (
                f"docs/configuration.md misses {section}.{f.name}"
            )


def test_as_dict_round_trips_through_overrides() -> None:
    cfg = load_config(overrides=["steps=4", "data.buckets=[[2, 128]]"])
    flat = {f"{s}.{k}": v for s, body in as_dict(cfg).items() for k, v in body.items()}
    assert load_config(overrides=flat) == cfg
