"""Both trace stores (SQLite and a real PostgreSQL) behave the same through the TraceStore API."""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest

from harnessrl.traces import open_store
from harnessrl.traces.schema import (
    TERMINAL_STATES,
    CallRecord,
    Choice,
    EndpointKind,
    InvalidTransition,
    RolloutRecord,
    RolloutState,
    UnknownRollout,
)


def make_call(rollout: str = "r1", n_tokens: int = 3, **kw: Any) -> CallRecord:
    fields: dict[str, Any] = dict(
        rollout_id=rollout,
        seq=-1,
        started_at=1.5,
        finished_at=2.25,
        endpoint=EndpointKind.CHAT,
        request={"messages": [{"role": "user", "content": "héllo"}], "n": 1},
        response={"choices": [{"index": 0}], "usage": {"prompt_tokens": 4}},
        prompt_token_ids=(1, 2, 3, 4),
        choices=(
            Choice(
                index=0,
                token_ids=tuple(range(10, 10 + n_tokens)),
                logprobs=tuple(-0.1234567890123456789 * (i + 1) for i in range(n_tokens)),
                finish_reason="stop",
                text="abc",
            ),
        ),
        policy_version=7,
        upstream="http://u1",
        latency_ms=0.75,
        status=200,
    )
    fields.update(kw)
    return CallRecord(**fields)


def test_calls_round_trip_exactly_with_store_assigned_seq(store: Any) -> None:
    first = make_call()
    second = make_call(n_tokens=0, choices=(), response=None, error="boom", status=502)
    assert store.add_call(first) == 0
    assert store.add_call(second) == 1
    assert store.add_call(make_call("other")) == 0
    got = store.calls("r1")
    assert [c.seq for c in got] == [0, 1]
    assert got[0] == CallRecord(**{**first.__dict__, "seq": 0})
    assert got[0].choices[0].logprobs == first.choices[0].logprobs  # bit-exact floats
    assert got[1].response is None and got[1].error == "boom" and not got[1].ok
    assert got[0].ok
    assert store.count_calls() == 3 and store.count_calls("r1") == 2
    assert store.calls("missing") == []


def test_add_calls_batches_many_rollouts_in_one_commit(store: Any) -> None:
    calls = [make_call(f"r{i % 3}") for i in range(9)]
    seqs = store.add_calls(calls)
    assert seqs == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert store.add_calls([]) == []
    assert [c.seq for c in store.calls("r2")] == [0, 1, 2]


def test_bad_calls_are_rejected_with_clear_errors(store: Any) -> None:
    bad_choice = Choice(index=0, token_ids=(1, 2), logprobs=(-1.0,), finish_reason=None)
    with pytest.raises(ValueError, match="2 token ids but 1 logprobs"):
        store.add_call(make_call(choices=(bad_choice,)))
    with pytest.raises(ValueError, match="rollout_id"):
        store.add_call(make_call(rollout=""))
    with pytest.raises(TypeError, match="CallRecord"):
        store.add_call({"rollout_id": "x"})
    for version in (2**63, -1, 1.0):  # stored as a 64-bit integer column
        with pytest.raises(ValueError, match="policy_version"):
            store.add_call(make_call(policy_version=version))
    deep: Any = []
    for _ in range(300):
        deep = [deep]
    with pytest.raises(TypeError, match="nest at most 254 levels"):
        store.add_call(make_call(request={"tools": deep}))
    assert store.count_calls() == 0  # nothing half-written
    assert store.add_call(make_call(policy_version=2**63 - 1)) == 0
    assert store.calls("r1")[0].policy_version == 2**63 - 1


def test_concurrent_writers_get_unique_contiguous_seqs(store_url: str) -> None:
    stores = [open_store(store_url) for _ in range(4)]

    def write(s: Any) -> None:
        for _ in range(10):
            s.add_call(make_call("shared"))

    threads = [threading.Thread(target=write, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [c.seq for c in stores[0].calls("shared")] == list(range(40))
    for s in stores:
        s.close()


def test_rollout_lifecycle(store: Any) -> None:
    store.create_rollout(RolloutRecord("a", task_id="t1", group_id="g1"))
    store.create_rollout(RolloutRecord("b", task_id="t1", group_id="g1", attempt=1))
    store.create_rollout(RolloutRecord("c", task_id="t2", group_id="g2"))
    with pytest.raises(ValueError, match="already exists"):
        store.create_rollout(RolloutRecord("a", task_id="t1", group_id="g1"))
    a = store.rollout("a")
    assert a.state is RolloutState.QUEUED and a.created_at > 0 and a.info == {}
    assert [r.rollout_id for r in store.rollouts("g1")] == ["a", "b"]
    assert len(store.rollouts()) == 3
    store.transition("a", RolloutState.RUNNING)
    done = store.transition("a", "succeeded", exit_code=0, info={"stderr": "x"})
    assert done.state is RolloutState.SUCCEEDED and done.exit_code == 0
    assert store.set_reward("a", 0.5).reward == 0.5  # a reward never changes the state
    assert store.rollout("a").state is RolloutState.SUCCEEDED
    merged = store.transition("b", RolloutState.FAILED, info={"k": 1}, reward=0.0)
    assert merged.reward == 0.0 and merged.info == {"k": 1}


def test_rollout_errors(store: Any) -> None:
    store.create_rollout(RolloutRecord("a", task_id="t", group_id="g", reward=None))
    with pytest.raises(UnknownRollout, match="unknown rollout 'nope'"):
        store.rollout("nope")
    with pytest.raises(UnknownRollout):
        store.transition("nope", RolloutState.RUNNING)
    with pytest.raises(UnknownRollout):
        store.set_reward("nope", 1.0)
    with pytest.raises(InvalidTransition, match="cannot go from 'queued' to 'succeeded'"):
        store.transition("a", RolloutState.SUCCEEDED)
    with pytest.raises(ValueError, match="state must be one of"):
        store.transition("a", "exploded")
    with pytest.raises(TypeError, match="unknown fields"):
        store.transition("a", RolloutState.RUNNING, colour="red")
    with pytest.raises(TypeError, match="exit_code"):
        store.transition("a", RolloutState.RUNNING, exit_code="0")
    with pytest.raises(TypeError, match="info"):
        store.transition("a", RolloutState.RUNNING, info=[1])
    with pytest.raises(ValueError, match="finite"):
        store.set_reward("a", math.nan)
    with pytest.raises(TypeError, match="number"):
        store.set_reward("a", "1")
    with pytest.raises(ValueError, match="task_id"):
        store.create_rollout(RolloutRecord("z", task_id="", group_id="g"))
    with pytest.raises(TypeError, match="RolloutRecord"):
        store.create_rollout({"rollout_id": "z"})
    for state in TERMINAL_STATES:
        rid = f"term-{state.value}"
        store.create_rollout(RolloutRecord(rid, task_id="t", group_id="g"))
        store.transition(rid, RolloutState.RUNNING)
        store.transition(rid, state)
        with pytest.raises(InvalidTransition, match="terminal"):
            store.transition(rid, RolloutState.RUNNING)
    assert store.rollout("a").state is RolloutState.QUEUED  # failed calls changed nothing


def test_closed_store_refuses_use(store_url: str) -> None:
    s = open_store(store_url)
    s.close()
    s.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        s.calls("r1")


def test_postgres_reconnects_after_a_dropped_connection(pg_dsn: str) -> None:
    from harnessrl.traces.postgres import PostgresTraceStore

    s = PostgresTraceStore(pg_dsn)
    s.add_call(make_call())
    s._conn.close()  # as if the server restarted between two calls
    assert s.add_call(make_call()) == 1
    s._conn.close()
    assert s.count_calls() == 2
    s.close()


def test_reward_on_create_is_validated(store: Any) -> None:
    with pytest.raises(ValueError, match="finite"):
        store.create_rollout(RolloutRecord("n", task_id="t", group_id="g", reward=math.inf))
    store.create_rollout(RolloutRecord("n", task_id="t", group_id="g", reward=1))
    assert store.rollout("n").reward == 1.0
