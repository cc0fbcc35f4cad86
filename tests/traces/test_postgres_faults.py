"""The PostgreSQL store under faults, on a real server: restarts, outages, connections cut at any byte.

A lost connection is replaced and the read or write runs again; a write whose COMMIT was cut is
never stored twice nor reported stored when it was not; an outage longer than the reconnect budget
fails with StoreUnavailable, and the store serves again once the server is back.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.parse
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pg_cluster import PgCluster
from tcp_cut import CutProxy
from test_trace_stores import make_call

from harnessrl.data.pipeline import read_traces
from harnessrl.rollout.evaluators import get_evaluator
from harnessrl.rollout.round import plan_round, run_round
from harnessrl.rollout.tasks import RunResult, RunSpec, Task
from harnessrl.traces.postgres import PostgresTraceStore
from harnessrl.traces.schema import CallRecord, RolloutRecord, RolloutState
from harnessrl.traces.sql import StoreUnavailable

pytestmark = pytest.mark.postgres


def big_call(rollout: str, i: int) -> CallRecord:
    """A call whose request and response are long enough for a cut to land inside them."""
    return make_call(
        rollout,
        n_tokens=40,
        request={"messages": [{"role": "user", "content": f"{rollout} call {i}"}]},
        response={"id": f"{rollout}-{i}", "choices": [{"text": "ok " * 200}]},
    )


def through(proxy: CutProxy, dsn: str) -> str:
    """`dsn` with its host and port replaced by the proxy's."""
    url = urllib.parse.urlsplit(dsn)
    return url._replace(netloc=f"{url.username}@127.0.0.1:{proxy.port}").geturl()


@pytest.fixture
def proxy(pg_dsn: str) -> Any:
    url = urllib.parse.urlsplit(pg_dsn)
    p = CutProxy(url.hostname or "127.0.0.1", url.port or 5432)
    yield p
    p.close()


def stored(dsn: str, rollout: str) -> list[tuple[int, str, Any]]:
    """(seq, request text, response) of each row, read past the store on a connection of its own."""
    with psycopg.connect(dsn) as conn:
        got = conn.execute(
            "SELECT seq, request->'messages'->0->>'content', response FROM calls "
            "WHERE rollout_id = %s ORDER BY seq",
            (rollout,),
        ).fetchall()
        counter = conn.execute(
            "SELECT next_seq FROM call_seq WHERE rollout_id = %s", (rollout,)
        ).fetchone()
    # The counter and the rows are written in one transaction: a gap would mean half a write.
    assert [r[0] for r in got] == list(range(len(got)))
    assert (counter[0] if counter else 0) == len(got)
    return [tuple(r) for r in got]


def test_restart_between_operations_is_invisible(pg_dsn: str, pg_ctl: PgCluster) -> None:
    store = PostgresTraceStore(pg_dsn)
    store.create_rollout(RolloutRecord("a", task_id="t", group_id="g"))
    assert store.add_calls([big_call("a", 0), big_call("a", 1)]) == [0, 1]
    pg_ctl.restart()
    assert [c.seq for c in store.calls("a")] == [0, 1]  # a read on a new connection
    pg_ctl.restart()
    assert store.add_call(big_call("a", 2)) == 2  # a write on a new connection
    pg_ctl.restart()
    assert store.transition("a", RolloutState.RUNNING).state is RolloutState.RUNNING
    assert [t for _, t, _ in stored(pg_dsn, "a")] == [f"a call {i}" for i in range(3)]
    store.close()


def test_a_write_during_an_outage_waits_for_the_server(pg_dsn: str, pg_ctl: PgCluster) -> None:
    store = PostgresTraceStore(pg_dsn, reconnect_timeout_s=30)
    store.add_call(big_call("w", 0))
    pg_ctl.stop()
    got: list[Any] = []
    writer = threading.Thread(target=lambda: got.append(store.add_call(big_call("w", 1))))
    t0 = time.monotonic()
    writer.start()
    time.sleep(0.5)
    assert got == []  # waiting for the server, not failed
    pg_ctl.start()
    writer.join(30)
    assert got == [1] and time.monotonic() - t0 < 30
    assert len(stored(pg_dsn, "w")) == 2
    store.close()


def test_an_outage_past_the_budget_fails_then_the_store_serves_again(
    pg_dsn: str, pg_ctl: PgCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PostgresTraceStore(pg_dsn, reconnect_timeout_s=0.5)
    store.add_call(big_call("o", 0))
    pg_ctl.stop()
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match=r"127\.0\.0\.1:\d+ unreachable for 0\.5s"):
            store.add_call(big_call("o", 1))
        assert 0.4 < time.monotonic() - t0 < 5
        attempts: list[float] = []
        connect = store._connect

        def counted() -> Any:
            attempts.append(time.monotonic())
            return connect()

        monkeypatch.setattr(store, "_connect", counted)
        with pytest.raises(StoreUnavailable):  # still down: fails at once, no second wait
            store.calls("o")
        assert len(attempts) == 1
    finally:
        pg_ctl.start()
    assert store.add_call(big_call("o", 2)) == 1  # nothing of the failed write was stored
    assert [t for _, t, _ in stored(pg_dsn, "o")] == ["o call 0", "o call 2"]
    store.close()


@pytest.mark.parametrize("before", [True, False], ids=["cut-before-commit", "cut-after-commit"])
def test_a_cut_commit_is_stored_exactly_once(pg_dsn: str, proxy: CutProxy, before: bool) -> None:
    """Cut after the COMMIT reached the server, the client cannot know it committed: the retry
    finds the write's token and returns its seqs; cut before, the retry writes it."""
    store = PostgresTraceStore(through(proxy, pg_dsn))
    store.create_rollout(RolloutRecord("c", task_id="t", group_id="g"))
    for i, op in enumerate(
        [
            lambda: store.add_calls([big_call("c", 0), big_call("c", 1)]),
            lambda: store.create_rollout(RolloutRecord("d", task_id="t", group_id="g")),
            lambda: store.transition("c", RolloutState.RUNNING),
            lambda: store.set_reward("c", 0.5),
        ]
    ):
        proxy.cut_at(b"COMMIT\x00", before=before)
        result = op()
        assert proxy.cuts == i + 1
        if i == 0:
            assert result == [0, 1]
    assert [t for _, t, _ in stored(pg_dsn, "c")] == ["c call 0", "c call 1"]
    assert store.rollout("c").state is RolloutState.RUNNING and store.rollout("c").reward == 0.5
    assert [r.rollout_id for r in store.rollouts("g")] == ["c", "d"]
    with psycopg.connect(pg_dsn) as conn:  # only the last write's token is kept
        assert conn.execute("SELECT count(*) FROM commit_tokens").fetchone() == (1,)
    store.close()


def test_a_connection_cut_twice_in_one_write_fails_cleanly(
    pg_dsn: str, proxy: CutProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PostgresTraceStore(through(proxy, pg_dsn))
    connect = store._connect

    def connect_and_cut() -> Any:
        conn = connect()
        proxy.cut_after("up", 0)  # the retry's connection is cut at its first statement too
        return conn

    proxy.cut_after("up", 0)
    monkeypatch.setattr(store, "_connect", connect_and_cut)
    with pytest.raises(StoreUnavailable, match="dropped the connection twice during one write"):
        store.add_call(big_call("x", 0))
    with pytest.raises(StoreUnavailable, match="twice during one read"):
        store.calls("x")
    monkeypatch.setattr(store, "_connect", connect)
    assert store.add_call(big_call("x", 1)) == 0
    assert [t for _, t, _ in stored(pg_dsn, "x")] == ["x call 1"]
    store.close()


def test_reconnect_settings_are_checked(pg_dsn: str) -> None:
    for name in ("connect_timeout_s", "reconnect_timeout_s", "lock_timeout_s"):
        with pytest.raises(ValueError, match=f"{name} must be a number of seconds > 0"):
            PostgresTraceStore(pg_dsn, **{name: 0})


def test_a_connection_lost_while_being_set_up_is_an_error_of_the_open(
    pg_dsn: str, proxy: CutProxy
) -> None:
    proxy.cut_at(b"SET lock_timeout", before=True)
    with pytest.raises(psycopg.OperationalError):
        PostgresTraceStore(through(proxy, pg_dsn))
    assert proxy.cuts == 1
    PostgresTraceStore(through(proxy, pg_dsn)).close()  # the next open is not cut


_OPS = 4  # create_rollout, add_calls, transition, set_reward: one sequence per example
_sizes: dict[str, int] = {}


def _sequence(store: PostgresTraceStore, rid: str) -> list[int]:
    store.create_rollout(RolloutRecord(rid, task_id="t", group_id="prop"))
    seqs = store.add_calls([big_call(rid, i) for i in range(3)])
    store.transition(rid, RolloutState.RUNNING)
    store.set_reward(rid, 1.0)
    return seqs


# HARNESSRL_SLOW=1 tries far more cut points.
@settings(
    max_examples=300 if os.environ.get("HARNESSRL_SLOW") else 15,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@given(direction=st.sampled_from(["up", "down"]), where=st.floats(0.0, 1.0))
def test_a_connection_cut_at_any_byte_never_leaves_half_a_record(
    pg_dsn: str, proxy: CutProxy, direction: str, where: float
) -> None:
    """Four writes, the connection cut once at a random byte of their traffic: each write is
    stored exactly once and whole (no call without its neighbours, no truncated response, no
    rollout left behind its calls), and every call reads back as written."""
    if not _sizes:  # the traffic of one uncut sequence, to place the cut inside it
        with PostgresTraceStore(through(proxy, pg_dsn)) as sizing:
            before = dict(proxy.sent)
            _sequence(sizing, "p9999")
            _sizes.update({d: proxy.sent[d] - before[d] for d in ("up", "down")})
    # A new session each time: psycopg prepares a statement run often on one connection, which
    # would make the traffic shorter than the sizing run's.
    store = PostgresTraceStore(through(proxy, pg_dsn))
    rid = f"p{len(store.rollouts('prop')):04d}"  # ids of one length: the same traffic each time
    cuts = proxy.cuts
    # (Timestamps are sent as text, a byte or two shorter or longer: stay clear of the end.)
    proxy.cut_after(direction, int(where * 0.95 * _sizes[direction]))
    assert _sequence(store, rid) == [0, 1, 2]
    proxy.disarm()
    assert proxy.cuts == cuts + 1
    rows = stored(pg_dsn, rid)
    assert [(t, r) for _, t, r in rows] == [
        (f"{rid} call {i}", big_call(rid, i).response) for i in range(3)
    ]
    assert store.calls(rid) == [
        CallRecord(**{**big_call(rid, i).__dict__, "seq": i}) for i in range(3)
    ]
    record = store.rollout(rid)
    assert (record.state, record.reward) == (RolloutState.RUNNING, 1.0)
    store.close()


class RestartingLauncher:
    """Runs each spec as a harness would through a sidecar (its calls go in by another store),
    then restarts the server before the loop reads the round back."""

    def __init__(self, dsn: str, cluster: PgCluster) -> None:
        self.dsn, self.cluster = dsn, cluster

    def run(self, specs: list[RunSpec]) -> list[RunResult]:
        with PostgresTraceStore(self.dsn) as sidecar:
            for s in specs:
                sidecar.add_calls([big_call(s.rollout_id, i) for i in range(2)])
        self.cluster.restart()
        return [
            RunResult(s.rollout_id, RolloutState.SUCCEEDED, 0, "", "", 0.1, s.task.answer or "")
            for s in specs
        ]


def test_the_loop_reads_its_round_across_restarts(pg_dsn: str, pg_ctl: PgCluster) -> None:
    store = PostgresTraceStore(pg_dsn)
    tasks = [Task("t0", "What is 1+1?", "2"), Task("t1", "What is 2+2?", "4")]
    specs = plan_round(tasks, prefix="s0", runs_per_task=2, base_url=lambda r: r, timeout_s=10.0)
    result = run_round(
        specs, RestartingLauncher(pg_dsn, pg_ctl), store, get_evaluator("exact_number")
    )
    assert result.calls == 8 and result.rewards == {s.rollout_id: 1.0 for s in specs}
    first = read_traces(store, result.group_ids)
    pg_ctl.restart()  # between the round and the step's read, or two reads of the viewer
    again = read_traces(store, result.group_ids)
    assert [r.rollout_id for r in again.rollouts] == [s.rollout_id for s in specs]
    assert again.rollouts == first.rollouts and again.calls == first.calls
    assert all(len(calls) == 2 for calls in again.calls.values())
    store.close()
