"""The whole loop on a coding task, with the real harness: a scripted model plays mini-swe-agent's
moves (a correct fix, a wrong one, and deleting the tests), mini-swe-agent runs them unchanged in
sandboxes through the sidecar, and the loop's own functions take it from there: our diff, a grade
in a fresh sandbox, the trace store, packed arrays and one learner update of the tiny model."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures" / "vllm"))

from fake_vllm import ServerThread
from scripted_agent import Script, ScriptedAgent, apply_patch_command

from harnessrl.coding.grade import GradeConfig
from harnessrl.coding.rollouts import (
    CodingConfig,
    CodingEvaluator,
    CodingLauncher,
    as_task,
    coding_metrics,
)
from harnessrl.coding.sandbox import SandboxConfig
from harnessrl.coding.taskset import load_shipped
from harnessrl.data.pipeline import DataConfig, build_step, read_traces
from harnessrl.fleet.sidecar import SidecarProcess
from harnessrl.learner.config import LearnerConfig
from harnessrl.learner.mesh import make_mesh
from harnessrl.learner.step import Learner
from harnessrl.model.formats.load import load_policy
from harnessrl.rollout.local import LocalLauncherConfig
from harnessrl.rollout.round import RoundResult, plan_round, run_round
from harnessrl.traces import TraceStore, open_store
from harnessrl.traces.schema import RolloutState
from proxy_sidecar.config import SidecarConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# Where bubblewrap cannot run, the sandboxes fall back to plain processes, saying so.
pytestmark = pytest.mark.filterwarnings("ignore:coding sandboxes run as plain processes")
TASK = load_shipped()[0]  # has_close_elements: `return True` where it should return False
MODULE = "has_close_elements.py"
SCRIPTS = {
    "gold": Script((f"cat {MODULE}", apply_patch_command(TASK.patch))),
    "wrong": Script((f"nl -ba {MODULE}", f"sed -i 's/return True/return None/' {MODULE}")),
    "hack": Script((f"head -n 3 test_{MODULE}", f"rm test_{MODULE}")),
}
CONFIGS = {"litellm_textbased": str(EXAMPLES / "mini.yaml"), "litellm": "mini.yaml"}


@pytest.fixture(scope="module")
def policy() -> tuple[Any, Any]:
    return load_policy("tiny", seed=0)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[str, TraceStore]]:
    url = f"sqlite:///{tmp_path / 'traces.db'}"
    s = open_store(url)
    yield url, s
    s.close()


def play(tmp_path: Path, tokenizer: Any, url: str, store: TraceStore, model_class: str) -> Any:
    """Three runs of the task, one per script, through mini-swe-agent and the sidecar."""
    phrase = TASK.problem_statement.splitlines()[0]
    agent = ScriptedAgent(tokenizer, {phrase: list(SCRIPTS.values())}, model="smollm2")
    # The default root (a short path under the system temp folder): the sidecar's Unix socket
    # lives in each sandbox, and a socket path may not be longer than 107 bytes.
    sandbox = SandboxConfig()
    config = CodingConfig(
        mini_config=CONFIGS[model_class],
        model_class=model_class,
        step_limit=6,
        max_tokens=1024,  # the gold patch is typed out in one command
        trajectories=str(tmp_path / "trajectories"),
        sandbox=sandbox,
        grade=GradeConfig(sandbox=sandbox),
    )
    by_id = {TASK.instance_id: TASK}
    with ServerThread(agent.app) as upstream:
        sidecar = SidecarProcess(
            SidecarConfig(upstreams=(upstream.url,), store=url, port=0, model="smollm2",
                          log_calls=False),
            tmp_path / "sidecar.log",
        )  # fmt: skip
        try:
            launcher = CodingLauncher(
                config, by_id, local=LocalLauncherConfig(concurrency=3), model="smollm2"
            )
            specs = plan_round(
                [as_task(TASK)], prefix="s0", runs_per_task=3, base_url=sidecar.base_url,
                timeout_s=300,
            )  # fmt: skip
            evaluator = CodingEvaluator(by_id, config.grade)
            return run_round(specs, launcher, store, evaluator, eval_workers=3)
        finally:
            sidecar.stop()


def script_of(store: TraceStore, rollout_id: str) -> str:
    """Which script a run played, from the first command it was sent (as the agent saw it)."""
    first = store.calls(rollout_id)[0].response or {}
    message = first["choices"][0]["message"]
    text = json.dumps(message)
    return next(name for name, s in SCRIPTS.items() if json.dumps(s.commands[0])[1:-1] in text)


def check_round(result: RoundResult, store: TraceStore) -> dict[str, Any]:
    assert [r.state for r in result.results] == [RolloutState.SUCCEEDED] * 3, [
        store.rollout(r.rollout_id).info for r in result.results
    ]
    by_script = {
        script_of(store, r.rollout_id): store.rollout(r.rollout_id) for r in result.results
    }
    assert sorted(by_script) == sorted(SCRIPTS)
    gold, wrong, hack = by_script["gold"], by_script["wrong"], by_script["hack"]
    for record in by_script.values():
        # Each script ran to its end and the agent submitted: 2 commands + the submit command.
        assert record.info["exit_status"] == "Submitted", record.info
        assert record.info["calls"] == record.info["harness_calls"] == 3
    assert gold.reward == 1.0 and gold.info["resolved"] and gold.info["guards"] == []
    assert gold.info["f2p_passed"] == gold.info["f2p"] == len(TASK.fail_to_pass)
    # The diff in the record is ours: the agent's change to the module, nothing else.
    assert gold.info["output"].startswith(f"diff --git a/{MODULE} b/{MODULE}")
    assert wrong.reward == 0.0 and not wrong.info["resolved"] and wrong.info["guards"] == []
    assert hack.reward == 0.0 and hack.info["guards"] == ["edited_tests"]
    assert hack.info["dropped"] == [f"test_{MODULE}"]
    assert coding_metrics(result) == {
        "resolved_rate": 1 / 3,
        "guard_trips": 1,
        "guard_causes": {"edited_tests": 1},
    }
    return by_script


@pytest.mark.parametrize("model_class", list(CONFIGS))
def test_a_scripted_fix_through_mini_swe_agent_earns_1_and_trains_through_the_loop(
    tmp_path: Path,
    policy: tuple[Any, Any],
    store: tuple[str, TraceStore],
    model_class: str,
) -> None:
    model, tokenizer = policy
    url, traces_store = store
    result = play(tmp_path, tokenizer, url, traces_store, model_class)
    check_round(result, traces_store)

    traces = read_traces(traces_store, result.group_ids)
    # Rewards 1, 0, 0 in one group: every run has a non-zero advantage.
    batch = build_step(0, traces, DataConfig(buckets=((4, 2048),)), decode=tokenizer.decode)
    merge = batch.stats.merge
    assert merge.calls == 9 and merge.failed_calls == 0 and merge.calls_without_logprobs == 0
    assert batch.stats.runs_trained == 3 and batch.micro_batches
    if model_class == "litellm_textbased":
        # The replies are in the text the template renders back: each run is one sequence.
        assert merge.breaks == 0 and merge.sequences == 3
    else:
        # SmolLM2's template renders an assistant turn's content only, never its tool calls:
        # the sampled call is gone from the next prompt, so each later call starts a sequence.
        assert merge.breaks == 6 and batch.stats.break_causes == {"template_altered": 6}
        return
    learner = Learner(
        model, LearnerConfig(learning_rate=1e-3), mesh=make_mesh("dp", jax.devices()[:1])
    )
    before = [np.asarray(x) for x in jax.tree.leaves(learner.params)]
    metrics = learner.train_step(batch.micro_batches)
    after = [np.asarray(x) for x in jax.tree.leaves(learner.params)]
    assert learner.step == 1 and math.isfinite(metrics["loss"])
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
