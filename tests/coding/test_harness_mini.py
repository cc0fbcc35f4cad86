"""mini-swe-agent, unchanged, run in coding sandboxes through the sidecar to the embedded server.

The server holds the tiny random model, so every reply is garbage: mini-swe-agent answers each one
with its format-error message and stops at its step limit or at its third malformed reply in a
row. What is checked is the plumbing: the agent runs (under bubblewrap where it works), each of
its model calls is captured in the store exactly as its own trajectory records it, the run is
graded from our diff, and build_step merges the calls, with every break explained.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harnessrl.coding.rollouts import CodingConfig, CodingEvaluator, CodingLauncher, as_task
from harnessrl.coding.sandbox import SandboxConfig, bwrap_problem
from harnessrl.coding.taskset import load_shipped
from harnessrl.data.pipeline import DataConfig, build_step, read_traces
from harnessrl.fleet.sidecar import SidecarProcess
from harnessrl.model.formats.load import load_policy
from harnessrl.rollout.local import LocalLauncherConfig
from harnessrl.rollout.round import plan_round, run_round
from harnessrl.serve.app import start_server
from harnessrl.serve.config import ServeConfig
from harnessrl.traces import TraceStore, open_store
from harnessrl.traces.schema import CallRecord, RolloutState
from proxy_sidecar.config import SidecarConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# Where bubblewrap cannot run, the sandboxes fall back to plain processes, saying so.
pytestmark = pytest.mark.filterwarnings("ignore:coding sandboxes run as plain processes")
STEP_LIMIT = 4
# mini-swe-agent's own text-based config and ours (short prompts), and its tool-calling one.
CONFIGS = {
    "litellm_textbased": str(EXAMPLES / "mini.yaml"),
    "litellm": "mini.yaml",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("mini")
    model, tokenizer = load_policy("tiny", seed=0)
    # mini-swe-agent's prompts are 600-1,100 tokens before any reply; one prefill chunk and one
    # decode length keep the server's compiles few.
    serve = ServeConfig(port=0, num_slots=4, max_model_len=2048, prefill_buckets=(1024,),
                        decode_buckets=(2048,))  # fmt: skip
    server = start_server(model, tokenizer, serve)
    url = f"sqlite:///{tmp / 'traces.db'}"
    try:
        sidecar = SidecarProcess(
            SidecarConfig(upstreams=(server.url,), store=url, port=0, model=serve.model_name,
                          log_calls=False),
            tmp / "sidecar.log",
        )  # fmt: skip
    except BaseException:
        server.stop()
        raise
    store = open_store(url)
    yield {"tmp": tmp, "sidecar": sidecar, "store": store, "model": serve.model_name,
           "tokenizer": tokenizer}  # fmt: skip
    store.close()
    sidecar.stop()
    server.stop()


def _messages_before(messages: list[dict[str, Any]], index: int) -> list[tuple[str, str]]:
    return [(m["role"], m.get("content") or "") for m in messages[:index]]


def _sent(call: CallRecord) -> list[tuple[str, str]]:
    request = call.request or {}
    return [(m["role"], m.get("content") or "") for m in request["messages"]]


def check_trajectory(store: TraceStore, rollout_id: str, trajectory: dict[str, Any]) -> int:
    """The store holds exactly the calls the agent's trajectory made, in order, each with the
    conversation the agent had at that point. Returns the number of calls."""
    calls = store.calls(rollout_id)
    messages = trajectory["messages"]
    # Each model call leaves one message holding its raw response: the reply, or (when the reply
    # was malformed and dropped from the conversation) the format-error message sent back.
    answered = [i for i, m in enumerate(messages) if "response" in (m.get("extra") or {})]
    assert len(calls) == len(answered) == trajectory["info"]["model_stats"]["api_calls"]
    for call, index in zip(calls, answered, strict=True):
        assert call.ok and call.prompt_token_ids and call.choices[0].token_ids
        assert (call.response or {})["id"] == messages[index]["extra"]["response"]["id"]
        assert _sent(call) == _messages_before(messages, index)
    return len(calls)


@pytest.mark.parametrize("model_class", list(CONFIGS))
def test_mini_swe_agent_runs_through_the_sidecar_and_every_call_is_captured_and_merged(
    stack: dict[str, Any], model_class: str
) -> None:
    tmp: Path = stack["tmp"]
    tasks = load_shipped()[:3]
    kept = tmp / f"trajectories-{model_class}"
    config = CodingConfig(
        mini_config=CONFIGS[model_class],
        model_class=model_class,
        step_limit=STEP_LIMIT,
        max_tokens=16,
        trajectories=str(kept),
        sandbox=SandboxConfig(),  # a short root: the sidecar's socket lives in each sandbox
    )
    by_id = {t.instance_id: t for t in tasks}
    launcher = CodingLauncher(
        config, by_id, local=LocalLauncherConfig(concurrency=3), model=stack["model"]
    )
    specs = plan_round(
        [as_task(t) for t in tasks],
        prefix=f"mini-{model_class}",
        runs_per_task=1,
        base_url=stack["sidecar"].base_url,
        timeout_s=300,
    )
    store: TraceStore = stack["store"]
    result = run_round(specs, launcher, store, CodingEvaluator(by_id, config.grade), eval_workers=2)

    assert [r.state for r in result.results] == [RolloutState.SUCCEEDED] * 3, [
        store.rollout(s.rollout_id).info for s in specs
    ]
    total = 0
    for spec in specs:
        record = store.rollout(spec.rollout_id)
        info = record.info
        # Garbage replies: the run ends at mini-swe-agent's third malformed reply in a row.
        assert info["exit_status"] == "RepeatedFormatError", info
        assert info["isolation"] == ("plain" if bwrap_problem() else "bwrap")
        # Graded from our diff (none: no action ever ran): the fix is missing, so 0, not None.
        assert record.reward == 0.0 and info["applied"] and not info["resolved"]
        assert info["f2p_passed"] == 0 and info["p2p_passed"] == info["p2p"] > 0
        trajectory = json.loads((kept / f"{spec.rollout_id}.traj.json").read_text())
        if model_class == "litellm":  # the tool-calling class offers its bash tool
            requests = [c.request or {} for c in store.calls(spec.rollout_id)]
            assert all(r["tools"][0]["function"]["name"] == "bash" for r in requests)
        total += check_trajectory(store, spec.rollout_id, trajectory)
        assert info["calls"] == info["harness_calls"] == 3
    assert result.calls == total == 9

    # Merged: each malformed reply is dropped from the agent's history, so the next prompt does
    # not extend the previous call's ids: a break at every call after a run's first, each one a
    # rewritten history (the reply's place is taken by the format-error message).
    traces = read_traces(store, result.group_ids)
    cfg = DataConfig(buckets=((2, 2048),), drop_zero_variance=False)
    batch = build_step(0, traces, cfg, decode=stack["tokenizer"].decode)
    merge = batch.stats.merge
    assert merge.calls == 9 and merge.failed_calls == 0 and merge.calls_without_logprobs == 0
    assert merge.breaks == 9 - 3 and merge.sequences == 9
    assert batch.stats.break_causes == {"history_rewritten": 6}
    assert batch.micro_batches and batch.stats.runs_trained == 3
