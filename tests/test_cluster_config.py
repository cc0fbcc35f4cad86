"""The shipped cluster train config, as each overlay's learner loads it: the recipe's buckets split
over its processes, no CPU-run step or time cap, and bucket rows that cannot split refused at load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from harnessrl.config import CLUSTER, load_config
from harnessrl.learner.mesh import load_slice_config, split_error

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
STORE = "rollout.store=postgresql://harnessrl@postgres/traces"
IMAGE = "rollout.kubernetes.image=registry.example.com/harnessrl:1"  # as the learner pods pass it


def train_yaml(tmp_path: Path) -> Path:
    (cm,) = [d for d in yaml.safe_load_all((K8S / "base" / "train-config.yaml").read_text()) if d]
    f = tmp_path / "train.yaml"
    f.write_text(cm["data"]["train.yaml"])
    return f


def learner_args(overlay_file: str) -> list[str]:
    (doc,) = [d for d in yaml.safe_load_all((K8S / overlay_file).read_text()) if d]
    spec: Any = doc["spec"]
    if doc["kind"] == "JobSet":
        spec = spec["replicatedJobs"][0]["template"]["spec"]
    (container,) = spec["template"]["spec"]["containers"]
    return [a for a in container["args"] if not a.startswith("rollout.store=")]


def kubelet_args(overlay_file: str, config: Path) -> list[str]:
    """The learner's argv as Kubernetes hands it over: $(VAR) expanded, the ConfigMap mounted."""
    return [
        a.replace("$(HARNESSRL_IMAGE)", "registry.example.com/harnessrl:1").replace(
            "/etc/harnessrl/train.yaml", str(config)
        )
        for a in learner_args(overlay_file)
    ]


@pytest.mark.parametrize("overlay_file", ["gke-tpu/learner-jobset.yaml", "gpu/learner-job.yaml"])
def test_each_learner_takes_its_recipe_whole_and_rows_split(
    overlay_file: str, tmp_path: Path
) -> None:
    cfg = load_config(None, [*kubelet_args(overlay_file, train_yaml(tmp_path)), STORE])
    recipe = load_slice_config(cfg.learner.mesh, check_devices=False)
    assert cfg.data.buckets == recipe.buckets
    assert cfg.data.step_token_budget == recipe.max_step_tokens
    assert cfg.learner.param_dtype == recipe.param_dtype and cfg.learner.remat == recipe.remat
    for rows, _ in cfg.data.buckets:
        assert rows % recipe.hosts == 0 and rows % (recipe.mesh["data"] * recipe.mesh["fsdp"]) == 0
    # A cluster run is not the embedded CPU run: no 13-minute budget, no 15-step stop.
    assert cfg.run.max_minutes == 0.0 and cfg.run.steps == CLUSTER["run.steps"] > 15


def test_rows_that_cannot_split_are_refused_at_load(tmp_path: Path) -> None:
    f = train_yaml(tmp_path)
    with pytest.raises(ValueError) as err:
        load_config(f, ["learner.mesh=v5e-32", STORE, IMAGE, "data.buckets=[[4,2048]]"])
    message = str(err.value)
    assert "data.buckets=[[4, 2048]]" in message and "learner.mesh=v5e-32" in message
    assert "multiples of data*fsdp=32 and of its 8 process(es)" in message
    assert "[[32, 3072], [64, 1536], [128, 768]]" in message  # what to change it to
    cfg = load_config(f, ["learner.mesh=v5e-32", STORE, IMAGE, "data.buckets=[[64,2048]]"])
    assert cfg.data.buckets == ((64, 2048),)


def test_user_settings_and_smoke_still_win(tmp_path: Path) -> None:
    f = train_yaml(tmp_path)
    cfg = load_config(
        f, ["learner.mesh=v5e-32", STORE, IMAGE, "run.steps=40", "run.max_minutes=90"]
    )
    assert (cfg.run.steps, cfg.run.max_minutes) == (40, 90.0)
    kube = ["rollout.launcher=kubernetes", STORE, "rollout.servers=http://v:1",
            "rollout.kubernetes.image=reg/harness:1"]  # fmt: skip
    smoke = load_config(None, kube,
                        smoke=True)  # fmt: skip
    assert (smoke.run.steps, smoke.run.max_minutes) == (2, 0.0)
    local = load_config(None, [])
    assert (local.run.steps, local.run.max_minutes) == (15, 13.0)  # the embedded CPU run


def test_split_error_counts_processes_too() -> None:
    v5e = load_slice_config("v5e-32", check_devices=False)
    assert split_error(((32, 8192),), v5e) is None
    assert "of 32" in (split_error(((16, 8192),), v5e) or "")
    assert split_error(((3, 8),), load_slice_config("cpu", check_devices=False)) is None
