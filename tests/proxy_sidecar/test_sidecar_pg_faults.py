"""The sidecar on a real PostgreSQL store under faults: kill -9 of the sidecar under load loses no
fully received call; a server restart mid-round makes calls wait and succeed (or, past the store's
reconnect budget, fail with a clean 503) and the sidecar's store reconnects by itself."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import orjson
import pytest
from load_client import check_no_call_lost, load_until_killed
from pg_cluster import PgCluster
from sidecar_proc import start_sidecar, start_upstream, stop

from harnessrl.traces.postgres import PostgresTraceStore
from harnessrl.traces.schema import RolloutRecord

pytestmark = pytest.mark.postgres


def test_kill_9_under_load_with_postgresql_loses_no_fully_received_call(pg_dsn: str) -> None:
    up, up_url = start_upstream(distinct=True)
    sc, url = start_sidecar(up_url, pg_dsn)
    try:
        done = asyncio.run(load_until_killed(url, sc, clients=16, after_s=1.0))
    finally:
        stop(sc)
        stop(up)
    with PostgresTraceStore(pg_dsn) as store:
        assert check_no_call_lost(done, store.calls) > 20
        # The killed sidecar's session left no lock or open transaction behind: writes go on.
        n = store.count_calls("k0")
        assert store.add_calls(store.calls("k0")[:1]) == [n]


@dataclass
class Outcome:
    rollout: str
    text: str
    stream: bool
    status: int
    raw: bytes
    started: float
    ended: float

    @property
    def whole(self) -> bool:
        """The client got the full response (a stream is whole only with its last event)."""
        if self.stream:
            return self.status == 200 and self.raw.endswith(b"data: [DONE]\n\n")
        return self.status == 200 and "choices" in orjson.loads(self.raw)


async def post(
    session: aiohttp.ClientSession, base: str, rollout: str, i: int, stream: bool
) -> Outcome:
    text = f"{rollout} call {i}"
    body = {"model": "smol", "messages": [{"role": "user", "content": text}], "stream": stream}
    started = time.monotonic()
    async with session.post(f"{base}/rollouts/{rollout}/v1/chat/completions", json=body) as r:
        raw = await r.read()
    return Outcome(rollout, text, stream, r.status, raw, started, time.monotonic())


def stored_texts(store: PostgresTraceStore, rollout: str) -> list[str]:
    calls = store.calls(rollout)
    assert [c.seq for c in calls] == list(range(len(calls)))  # once each, no gap
    return [c.request["messages"][0]["content"] for c in calls]


def test_a_restart_mid_round_makes_calls_wait_and_loses_none(
    fake: Any, make_sidecar: Any, pg_dsn: str, pg_ctl: PgCluster
) -> None:
    store = PostgresTraceStore(pg_dsn)  # waits up to 30 s for the server to come back
    sc = make_sidecar((fake[1].url,), store=store)
    outcomes: list[Outcome] = []
    running = True
    marks: dict[str, float] = {}

    async def harness(session: aiohttp.ClientSession, k: int) -> None:
        i = 0
        while running:
            outcomes.append(await post(session, sc.url, f"h{k}", i, stream=i % 2 == 1))
            i += 1

    async def main() -> None:
        nonlocal running
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            tasks = [asyncio.create_task(harness(session, k)) for k in range(6)]
            await asyncio.sleep(0.3)
            await asyncio.to_thread(pg_ctl.stop)
            marks["down"] = time.monotonic()
            # The event loop keeps serving while calls wait for the store (it answers before the
            # server is started again).
            wait = aiohttp.ClientTimeout(total=20)
            async with session.get(f"{sc.url}/health", timeout=wait) as health:
                assert health.status == 200
            await asyncio.sleep(0.3)
            await asyncio.to_thread(pg_ctl.start)
            marks["up"] = time.monotonic()
            # Until calls made after the restart have come back (the store polls the server).
            while not [o for o in outcomes if o.started > marks["up"]]:
                assert time.monotonic() - marks["up"] < 30, "no call came back after the restart"
                await asyncio.sleep(0.05)
            running = False
            await asyncio.gather(*tasks)

    asyncio.run(main())
    bad = [(o.rollout, o.text, o.status, o.raw[-300:]) for o in outcomes if not o.whole]
    assert bad == [], f"{len(bad)} of {len(outcomes)} calls not answered whole: {bad[:3]}"
    waited = [o for o in outcomes if o.started < marks["down"] + 0.3 and o.ended > marks["up"]]
    assert waited, "no call was in flight while the server was down"
    by_rollout: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_rollout.setdefault(o.rollout, []).append(o)
    for rollout, got in by_rollout.items():
        # Every call the client got whole is stored once, in order (the sidecar was never
        # restarted: its store reconnected by itself), with the ids the client received.
        assert stored_texts(store, rollout) == [o.text for o in got]
        for o, rec in zip(got, store.calls(rollout), strict=True):
            if not o.stream:
                assert (
                    list(rec.choices[0].token_ids) == orjson.loads(o.raw)["choices"][0]["token_ids"]
                )
            assert rec.ok and rec.response is not None


def test_an_outage_past_the_reconnect_budget_fails_calls_cleanly(
    fake: Any, make_sidecar: Any, pg_dsn: str, pg_ctl: PgCluster
) -> None:
    store = PostgresTraceStore(pg_dsn, reconnect_timeout_s=0.5)
    sc = make_sidecar((fake[1].url,), store=store)

    async def main() -> list[Outcome]:
        async with aiohttp.ClientSession() as session:
            first = await post(session, sc.url, "o", 0, stream=False)
            await asyncio.to_thread(pg_ctl.stop)
            try:
                failed = [
                    await post(session, sc.url, "o", 1, stream=False),
                    await post(session, sc.url, "o", 2, stream=True),
                ]
            finally:
                await asyncio.to_thread(pg_ctl.start)
            # The same sidecar, never restarted: its store reconnects by itself.
            return [first, *failed, await post(session, sc.url, "o", 3, stream=True)]

    first, plain, streamed, after = asyncio.run(main())
    assert first.whole and after.whole
    assert plain.status == 503 and plain.ended - plain.started < 5
    error = orjson.loads(plain.raw)["error"]
    assert error["code"] == 503 and error["type"] == "service_unavailable"
    assert "trace store could not record the call" in error["message"]
    # A stream's headers went out before its record: it ends in an error event, never [DONE].
    assert not streamed.whole and b"trace store could not record the call" in streamed.raw
    assert stored_texts(store, "o") == ["o call 0", "o call 3"]  # nothing of the failed calls
    assert "sidecar_store_errors_total 2.0" in httpx.get(sc.url + "/metrics").text


def test_a_reward_during_an_outage_past_the_budget_is_a_503_then_lands(
    fake: Any, make_sidecar: Any, pg_dsn: str, pg_ctl: PgCluster
) -> None:
    store = PostgresTraceStore(pg_dsn, reconnect_timeout_s=0.5)
    sc = make_sidecar((fake[1].url,), store=store, control_token="t0ken")
    store.create_rollout(RolloutRecord("r", task_id="t", group_id="g"))
    auth = {"authorization": "Bearer t0ken"}
    pg_ctl.stop()
    try:
        r = httpx.post(sc.url + "/rollouts/r/reward", json={"reward": 1.0}, headers=auth)
    finally:
        pg_ctl.start()
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    error = r.json()["error"]
    assert error["type"] == "service_unavailable" and "trace store unavailable" in error["message"]
    # The harness retries as told; the same sidecar's store is back.
    r = httpx.post(sc.url + "/rollouts/r/reward", json={"reward": 1.0}, headers=auth)
    assert r.status_code == 200 and store.rollout("r").reward == 1.0
