"""Control API (pause/resume/version/mode, bearer token) and rollout API (reward, finish)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import httpx
import pytest

from harnessrl.traces.schema import RolloutRecord, RolloutState

TOKEN = "s3cret-token"
CHAT = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def wait_until(cond: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture
def guarded(fake: Any, make_sidecar: Any) -> Any:
    return make_sidecar((fake[1].url,), control_token=TOKEN, pause_timeout_s=0.5)


def test_token_is_required_and_compared(guarded: Any) -> None:
    url = guarded.url
    assert httpx.get(url + "/control/status").status_code == 401
    bad = httpx.post(url + "/control/pause", headers=auth("wrong"))
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    assert (
        httpx.get(url + "/control/status", headers={"authorization": "Basic " + TOKEN}).status_code
        == 401
    )
    assert httpx.post(url + "/rollouts/x/reward", json={"reward": 1}).status_code == 401
    ok = httpx.get(url + "/control/status", headers=auth())
    assert ok.json() == {
        "paused": False, "in_flight": 0, "policy_version": None, "upstream_versions": {},
        "mode": "train",
    }  # fmt: skip
    # Model calls themselves never need the control token.
    assert httpx.post(guarded.base("r") + "/chat/completions", json=CHAT).status_code == 200


def test_pause_holds_calls_then_resume_releases_them(guarded: Any) -> None:
    url = guarded.url
    assert httpx.post(url + "/control/pause", headers=auth()).json()["paused"] is True
    results: list[int] = []

    def harness_call() -> None:
        results.append(
            httpx.post(guarded.base("p") + "/chat/completions", json=CHAT, timeout=10).status_code
        )

    worker = threading.Thread(target=harness_call)
    worker.start()
    time.sleep(0.2)
    assert results == []  # waiting, not failing
    assert httpx.post(url + "/control/resume", headers=auth()).json()["paused"] is False
    worker.join(60)
    assert results == [200]
    assert guarded.store.count_calls("p") == 1


def test_pause_wait_is_bounded(guarded: Any) -> None:
    httpx.post(guarded.url + "/control/pause", headers=auth())
    t0 = time.monotonic()
    r = httpx.post(guarded.base("q") + "/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 503 and "paused" in r.json()["error"]["message"]
    assert 0.4 < time.monotonic() - t0 < 5
    httpx.post(guarded.url + "/control/resume", headers=auth())


def test_pause_with_drain_waits_for_in_flight_calls(fake: Any, guarded: Any) -> None:
    fake[0].delay_s = 1.0
    workers = [
        threading.Thread(
            target=lambda: httpx.post(
                guarded.base("d") + "/chat/completions", json=CHAT, timeout=10
            )
        )
        for _ in range(2)
    ]
    workers[0].start()
    wait_until(lambda: guarded.state.in_flight == 1)
    status = httpx.post(
        guarded.url + "/control/pause", json={"drain_timeout_s": 5}, headers=auth()
    ).json()
    assert status["in_flight"] == 0 and status["paused"] is True
    httpx.post(guarded.url + "/control/resume", headers=auth())
    workers[1].start()
    wait_until(lambda: guarded.state.in_flight == 1)
    short = httpx.post(
        guarded.url + "/control/pause", json={"drain_timeout_s": 0.01}, headers=auth()
    )
    assert short.status_code == 409  # could not drain: the pause is withdrawn
    assert httpx.get(guarded.url + "/control/status", headers=auth()).json()["paused"] is False
    for w in workers:
        w.join()
    fake[0].delay_s = 0.0
    assert guarded.store.count_calls("d") == 2


def test_policy_version_from_control_and_from_upstream_header(fake: Any, guarded: Any) -> None:
    r = httpx.post(guarded.url + "/control/policy_version", json={"version": 4}, headers=auth())
    assert r.json()["policy_version"] == 4
    httpx.post(guarded.base("v") + "/chat/completions", json=CHAT)
    fake[0].policy_version = 9  # the server says which weights answered: that wins
    httpx.post(guarded.base("v") + "/chat/completions", json={**CHAT, "stream": True})
    fake[0].policy_version = None
    assert [c.policy_version for c in guarded.store.calls("v")] == [4, 9]
    for body in ({"version": -1}, {"version": "3"}, {"version": True}, {}, {"version": 1.5}):
        bad = httpx.post(guarded.url + "/control/policy_version", json=body, headers=auth())
        assert bad.status_code == 400 and "version" in bad.json()["error"]["message"]
    metrics = httpx.get(guarded.url + "/metrics").text
    assert "sidecar_policy_version 4.0" in metrics


def test_policy_versions_stay_within_what_the_store_keeps(
    fake: Any, guarded: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The stores keep 64-bit versions. 2**63 from the control API is a 400 (accepted, it would
    make every later call unstorable); from the upstream's header it is ignored with a warning,
    like any unreadable header, and the control API's version is recorded instead."""
    url = guarded.url + "/control/policy_version"
    too_big = httpx.post(url, json={"version": 2**63}, headers=auth())
    assert too_big.status_code == 400 and "2**63 - 1" in too_big.json()["error"]["message"]
    assert too_big.json()["error"]["param"] == "version"
    assert httpx.post(url, json={"version": 2**63 - 1}, headers=auth()).status_code == 200
    assert httpx.post(guarded.base("big") + "/chat/completions", json=CHAT).status_code == 200
    fake[0].policy_version = 2**63
    with caplog.at_level(logging.WARNING, logger="proxy_sidecar.proxy"):
        for stream in (False, True, False):
            body = {**CHAT, "stream": stream}
            r = httpx.post(guarded.base("big") + "/chat/completions", json=body)
            assert r.status_code == 200
    fake[0].policy_version = None
    assert [c.policy_version for c in guarded.store.calls("big")] == [2**63 - 1] * 4
    assert all(c.ok for c in guarded.store.calls("big"))
    warnings = [r.getMessage() for r in caplog.records if r.name == "proxy_sidecar.proxy"]
    assert len(warnings) == 1 and "9223372036854775808" in warnings[0]  # once per upstream


def test_mode_switch_applies_that_modes_overrides(fake: Any, make_sidecar: Any) -> None:
    sc = make_sidecar(
        (fake[1].url,),
        model="smol",
        train_overrides={"temperature": 1.0},
        eval_overrides={"temperature": 0.0, "seed": 1},
    )
    httpx.post(sc.base("m") + "/chat/completions", json={**CHAT, "model": "harness-name"})
    assert fake[0].requests[-1]["temperature"] == 1.0 and fake[0].requests[-1]["model"] == "smol"
    assert httpx.post(sc.url + "/control/mode", json={"mode": "eval"}).json()["mode"] == "eval"
    httpx.post(sc.base("m") + "/chat/completions", json=CHAT)
    assert fake[0].requests[-1]["temperature"] == 0.0 and fake[0].requests[-1]["seed"] == 1
    assert httpx.post(sc.url + "/control/mode", json={"mode": "play"}).status_code == 400
    assert sc.store.calls("m")[1].request["temperature"] == 0.0


def test_control_bodies_must_be_json_objects(guarded: Any) -> None:
    for content in (b"{", b"[1]"):
        r = httpx.post(guarded.url + "/control/policy_version", content=content, headers=auth())
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
    big = httpx.post(guarded.url + "/control/pause", content=b" " * (2 << 20), headers=auth())
    assert big.status_code == 413  # the same limit answer as the proxy path
    httpx.post(guarded.url + "/control/resume", headers=auth())


def test_reward_and_finish(guarded: Any) -> None:
    store, url = guarded.store, guarded.url
    store.create_rollout(RolloutRecord("r1", task_id="t", group_id="g"))
    r = httpx.post(url + "/rollouts/r1/reward", json={"reward": 0.25}, headers=auth())
    assert r.json() == {"rollout_id": "r1", "state": "queued", "reward": 0.25}
    done = httpx.post(
        url + "/rollouts/r1/finish",
        json={"state": "succeeded", "exit_code": 0, "info": {"a": 1}},
        headers=auth(),
    )
    assert done.status_code == 200 and done.json()["state"] == "succeeded"
    rec = store.rollout("r1")
    assert rec.state is RolloutState.SUCCEEDED and rec.exit_code == 0 and rec.info == {"a": 1}
    again = httpx.post(url + "/rollouts/r1/finish", json={"state": "failed"}, headers=auth())
    assert (
        again.status_code == 409
        and "cannot go from 'succeeded'" in again.json()["error"]["message"]
    )
    assert (
        httpx.post(url + "/rollouts/nope/reward", json={"reward": 1}, headers=auth()).status_code
        == 404
    )
    for body in ({"reward": "high"}, {"reward": float("inf")}, {}):
        assert (
            httpx.post(
                url + "/rollouts/r1/reward",
                content=str(body).replace("'", '"').replace("inf", "1e999"),
                headers=auth(),
            ).status_code
            == 400
        )
    assert (
        httpx.post(
            url + "/rollouts/r1/finish", json={"state": "running"}, headers=auth()
        ).status_code
        == 400
    )
    store.create_rollout(RolloutRecord("r2", task_id="t", group_id="g"))
    bad = httpx.post(
        url + "/rollouts/r2/finish", json={"state": "failed", "exit_code": "x"}, headers=auth()
    )
    assert bad.status_code == 400 and "exit_code" in bad.json()["error"]["message"]


def test_loopback_without_token_leaves_control_open(sidecar: Any) -> None:
    assert httpx.post(sidecar.url + "/control/pause").status_code == 200
    assert httpx.post(sidecar.url + "/control/resume").json()["paused"] is False
