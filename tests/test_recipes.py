"""recipes/*.yaml: each loads into a TrainConfig that fits its hardware recipe and Qwen3-8B, stops on
every SET-ME value left unset, and docs/recipes.md's commands are the project's own and complete."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_docs_commands import doc_commands, program_of, project_module

from harnessrl.cli import get, leaves
from harnessrl.coding.repo import mirror_of
from harnessrl.coding.rollouts import coding_task_sets, is_coding
from harnessrl.coding.tasks import task_from_row
from harnessrl.config import TrainConfig, load_config
from harnessrl.fleet import remote_serving
from harnessrl.learner.mesh import TPU_CONFIGS_DIR, load_slice_config, recipe_path
from harnessrl.learner.plan import check_fits, run_settings
from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.formats.load import load_policy

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
DOC = REPO / "docs" / "recipes.md"
MARK = "SET-ME"
# What only the user has: the checkpoint, the task files, the servers and the mirrors.
REQUIRED = {
    "serve.model",
    "rollout.tasks",
    "rollout.eval_tasks",
    "rollout.servers",
    "rollout.coding.sandbox.mirrors",
    "rollout.coding.grade.sandbox.mirrors",
}
# Qwen/Qwen3-8B's config.json, the fields harnessrl.model reads.
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


def swe_row(instance_id: str, repo: str) -> dict[str, object]:
    return {
        "instance_id": instance_id,
        "repo": repo,
        "base_commit": "0" * 40,
        "problem_statement": "Calling parse() on an empty string raises IndexError instead of "
        "returning an empty list.",
        "patch": "diff --git a/p.py b/p.py\n",
        "test_patch": "diff --git a/test_p.py b/test_p.py\n",
        "FAIL_TO_PASS": json.dumps(["test_p.py::test_empty"]),
        "PASS_TO_PASS": json.dumps(["test_p.py::test_one"]),
    }


@pytest.fixture
def filled(tmp_path: Path) -> dict[str, str]:
    """A value for every SET-ME key: a Qwen3-8B config folder, one train row, one eval row."""
    model = tmp_path / "Qwen3-8B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_8B))
    train, held = tmp_path / "train.jsonl", tmp_path / "verified.jsonl"
    train.write_text(json.dumps(swe_row("pallets__flask-1", "pallets/flask")) + "\n")
    held.write_text(json.dumps(swe_row("psf__requests-2", "psf/requests")) + "\n")
    mirrors = tmp_path / "mirrors"
    mirrors.mkdir()
    return {
        "serve.model": str(model),
        "rollout.tasks": f"coding:{train}",
        "rollout.eval_tasks": f"coding:{held}",
        "rollout.servers": "http://vllm-0:8000,http://vllm-1:8000",
        "rollout.coding.sandbox.mirrors": str(mirrors),
        "rollout.coding.grade.sandbox.mirrors": str(mirrors),
    }


def unset(cfg: TrainConfig) -> set[str]:
    """Keys whose value still holds the placeholder."""
    return {k for k in leaves(TrainConfig) if MARK in str(get(cfg, k))}


def longest(cfg: TrainConfig) -> int:
    return max(length for _rows, length in cfg.data.buckets)


def runs_per_step(cfg: TrainConfig) -> int:
    return cfg.rollout.tasks_per_step * cfg.rollout.group_size


def test_there_are_recipes() -> None:
    names = {p.stem for p in RECIPES}
    assert {"qwen3-8b-swe-8xh100", "qwen3-8b-swe-8xh200", "qwen3-8b-swe-v5p-64"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_loads_with_its_values_set(recipe: Path, filled: dict[str, str]) -> None:
    cfg = load_config(recipe, filled)
    assert isinstance(cfg, TrainConfig)
    assert unset(cfg) == set()
    assert cfg.serve.model == filled["serve.model"]
    assert ModelConfig.from_hf_config(json.loads(Path(cfg.serve.model, "config.json").read_text()))
    r = cfg.rollout
    assert (r.launcher, r.evaluator, r.weight_sync) == ("local", "coding", "vllm")
    assert is_coding(r.tasks) and is_coding(r.eval_tasks)
    sets = coding_task_sets(r.tasks, r.eval_tasks, r.num_eval_tasks)
    assert [t.task_id for t in sets.train] == ["pallets__flask-1"]
    assert [t.task_id for t in sets.eval] == ["psf__requests-2"]  # Verified rows, held out
    assert remote_serving(r.servers, r.weight_sync, Path("weights"), None).url == r.servers
    assert r.coding.sandbox.isolation == r.coding.grade.sandbox.isolation == "bwrap"
    assert cfg.sidecar.model, "the vLLM servers' --served-model-name"
    assert cfg.run.max_minutes == 0 and cfg.run.steps >= cfg.run.eval_every


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_each_unset_value_stops_the_run_naming_it(recipe: Path, tmp_path: Path) -> None:
    cfg = load_config(recipe)
    assert unset(cfg) == REQUIRED
    r = cfg.rollout
    # What the loop calls with each value, in the order setup() calls them.
    with pytest.raises(ValueError, match=MARK):
        coding_task_sets(r.tasks, r.eval_tasks, r.num_eval_tasks)
    with pytest.raises(ValueError, match=MARK):
        load_policy(cfg.serve.model)
    with pytest.raises(ValueError, match=MARK):
        remote_serving(r.servers, r.weight_sync, tmp_path, None)
    task = task_from_row(swe_row("pallets__flask-1", "pallets/flask"), where="row 1")
    for mirrors in (r.coding.sandbox.mirrors, r.coding.grade.sandbox.mirrors):
        with pytest.raises(ValueError, match=MARK):
            mirror_of(task, mirrors)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_mesh_recipe_is_a_tpu_config_and_applies_whole(recipe: Path) -> None:
    cfg = load_config(recipe)
    path = recipe_path(cfg.learner.mesh)
    assert path is not None and path.parent == TPU_CONFIGS_DIR, cfg.learner.mesh
    target = load_slice_config(cfg.learner.mesh, check_devices=False)
    assert recipe.stem.endswith(target.name.lower())
    lr = cfg.learner
    assert (lr.compute_dtype, lr.param_dtype, lr.remat) == (
        target.compute_dtype,
        target.param_dtype,
        target.remat,
    )
    assert cfg.data.step_token_budget == target.max_step_tokens
    shards = target.mesh["data"] * target.mesh["fsdp"]
    for rows, _length in cfg.data.buckets:
        assert rows % shards == 0, f"rows {rows} split over data x fsdp = {shards}"
        assert rows % target.hosts == 0, f"rows {rows} split over {target.hosts} processes"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_buckets_fit_the_model_and_a_step_fits_the_budget(recipe: Path) -> None:
    cfg = load_config(recipe)
    model = ModelConfig.from_hf_config(QWEN3_8B)
    assert longest(cfg) <= model.max_position_embeddings
    # The longest bucket is the servers' context: a run at full length still fits one row, and
    # a step of full-length runs fits the budget, so no run is split or waits for a later step.
    budget = cfg.data.step_token_budget
    assert budget is not None and runs_per_step(cfg) * longest(cfg) <= budget
    assert cfg.rollout.local.concurrency >= runs_per_step(cfg)


def doc_table_row(recipe: Path) -> list[str]:
    text = DOC.read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith(f"| `recipes/{recipe.name}` |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_doc_states_each_recipe_as_it_is(recipe: Path) -> None:
    cfg = load_config(recipe)
    _name, _learner, _servers, context, runs, steps = doc_table_row(recipe)
    assert context == f"{longest(cfg):,}"
    assert runs.split()[0] == str(cfg.rollout.tasks_per_step)
    assert runs.split("×")[1].strip() == str(cfg.rollout.group_size)
    assert steps == str(cfg.run.steps)
    # The servers are started with the same context (`--max-model-len`).
    servers = DOC.read_text().split("## What runs where")[1].split("\n## ")[0]
    assert re.search(rf"\b{longest(cfg)}\b", servers), f"no --max-model-len {longest(cfg)}"


def cost_cell(row: str, mesh: str) -> str:
    """The cell of the cost tables' `row` in the column headed by `mesh`."""
    lines = DOC.read_text().split("## Expected cost")[1].splitlines()
    header = next(ln for ln in lines if ln.startswith("| |") and f"| {mesh} |" in ln)
    column = [c.strip() for c in header.strip("|").split("|")].index(mesh)
    line = next(ln for ln in lines if ln.startswith(f"| {row}"))
    return [c.strip() for c in line.strip("|").split("|")][column]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_doc_cost_arithmetic_starts_from_the_recipe(recipe: Path) -> None:
    cfg = load_config(recipe)
    runs, context = runs_per_step(cfg), longest(cfg)
    tokens = cost_cell("tokens trained", cfg.learner.mesh)
    assert tokens == f"{runs} × {context:,} = {runs * context:,}"
    steps = cost_cell("the runs of a step", cfg.learner.mesh)
    assert steps.startswith(f"{cfg.rollout.coding.step_limit} × ")
    assert cost_cell("training", cfg.learner.mesh).startswith(f"{cfg.run.steps} × ")


def test_doc_commands_name_modules_that_exist() -> None:
    commands = doc_commands(DOC)
    modules = {program_of(c)[0][3:] for c in commands if program_of(c)[0].startswith("-m ")}
    ours = {m for m in modules if project_module(m)}
    assert {"harnessrl.train", "harnessrl.curate"} <= ours
    for module in ours:
        assert importlib.util.find_spec(module) is not None, module


def test_doc_train_command_sets_every_unset_value() -> None:
    """The spelled-out command, and the same keys on each other recipe, leave no SET-ME."""
    trains = [c for c in doc_commands(DOC) if program_of(c)[0] == "-m harnessrl.train"]
    spelled = [c for c in trains if any(w.startswith("recipes/") for w in c.words)]
    assert spelled, "docs/recipes.md spells out a train command with a recipe"
    for command in spelled:
        words = list(command.words)
        overrides = [w for w in words if "=" in w and not w.startswith("--")]
        assert {w.split("=", 1)[0] for w in overrides} >= REQUIRED
        for recipe in RECIPES:
            cfg = load_config(recipe, overrides)
            assert unset(cfg) == set(), (recipe.name, unset(cfg))
            assert dataclasses.asdict(cfg)  # a complete, valid TrainConfig


def test_the_train_command_stops_on_the_first_unset_value(tmp_path: Path) -> None:
    """The real command line: the task files first, then the model, with the doc's message."""
    recipe = REPO / "recipes" / "qwen3-8b-swe-8xh100.yaml"
    train, held = tmp_path / "train.jsonl", tmp_path / "verified.jsonl"
    train.write_text(json.dumps(swe_row("pallets__flask-1", "pallets/flask")) + "\n")
    held.write_text(json.dumps(swe_row("psf__requests-2", "psf/requests")) + "\n")
    argv = [sys.executable, "-m", "harnessrl.train", "--config", str(recipe)]
    argv.append(f"run.out_dir={tmp_path / 'run'}")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def stderr(*overrides: str) -> str:
        proc = subprocess.run([*argv, *overrides], env=env, capture_output=True, text=True,
                              timeout=240, cwd=tmp_path)  # fmt: skip
        assert proc.returncode != 0
        return proc.stderr

    assert "tasks path 'SET-ME: the cleaned and probed train rows" in stderr()
    quoted = DOC.read_text().split("```text\n")[1].split("\n```")[0]
    tasks = (f"rollout.tasks=coding:{train}", f"rollout.eval_tasks=coding:{held}")
    assert f"ValueError: {quoted}" in stderr(*tasks)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_the_memory_planner_reads_each_recipe_as_the_loop_does(recipe: Path) -> None:
    cfg = load_config(recipe)
    learner, buckets, target = run_settings(str(recipe))
    assert learner == cfg.learner and buckets == cfg.data.buckets
    assert target.name == load_slice_config(cfg.learner.mesh, check_devices=False).name
    # Each recipe is sized for Qwen3-8B (its file says so): the loop's own check passes.
    plan = check_fits(str(REPO / "tests" / "fixtures"), cfg.learner, cfg.data.buckets)
    assert plan is None  # no config.json there: nothing is planned
    plan = check_fits("qwen3-8b", cfg.learner, cfg.data.buckets)
    assert plan is not None and plan.fits
