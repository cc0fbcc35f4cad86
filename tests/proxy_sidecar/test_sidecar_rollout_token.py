"""A rollout's own credential (HMAC of its id under the control token): it posts that rollout's
reward while the run is open, and nothing else: no other rollout, no /finish, no control API."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from harnessrl.traces.schema import RolloutRecord, RolloutState
from proxy_sidecar.control import rollout_token

TOKEN = "s3cret-token"


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture
def guarded(fake: Any, make_sidecar: Any) -> Any:
    sidecar = make_sidecar((fake[1].url,), control_token=TOKEN)
    for rid in ("r1", "r2"):
        sidecar.store.create_rollout(RolloutRecord(rid, task_id="t", group_id="g"))
    return sidecar


def test_rollout_token_is_per_rollout_and_per_control_token() -> None:
    own = rollout_token(TOKEN, "r1")
    assert own == rollout_token(TOKEN, "r1") and len(own) == 64 and int(own, 16) >= 0
    assert own != rollout_token(TOKEN, "r2") and own != rollout_token("other-token", "r1")
    assert TOKEN not in own


def test_a_rollout_posts_its_own_reward(guarded: Any) -> None:
    r = httpx.post(
        guarded.url + "/rollouts/r1/reward",
        json={"reward": 0.75},
        headers=bearer(rollout_token(TOKEN, "r1")),
    )
    assert r.status_code == 200, r.text
    assert r.json() == {"rollout_id": "r1", "state": "queued", "reward": 0.75}
    assert guarded.store.rollout("r1").reward == 0.75


def test_a_rollout_credential_is_refused_everywhere_else(guarded: Any) -> None:
    url, own = guarded.url, bearer(rollout_token(TOKEN, "r1"))
    other = httpx.post(url + "/rollouts/r2/reward", json={"reward": 1.0}, headers=own)
    assert other.status_code == 401
    assert other.json()["error"]["type"] == "authentication_error"
    assert "'r2'" in other.json()["error"]["message"]
    assert guarded.store.rollout("r2").reward is None
    foreign = bearer(rollout_token("another-sidecars-token", "r1"))
    assert (
        httpx.post(url + "/rollouts/r1/reward", json={"reward": 1.0}, headers=foreign).status_code
        == 401
    )
    finish = httpx.post(url + "/rollouts/r1/finish", json={"state": "succeeded"}, headers=own)
    assert finish.status_code == 401
    assert guarded.store.rollout("r1").state is RolloutState.QUEUED
    for path in ("/control/pause", "/control/policy_version"):
        assert httpx.post(url + path, json={"version": 3}, headers=own).status_code == 401
    assert httpx.get(url + "/control/status", headers=own).status_code == 401
    assert guarded.state.paused is False and guarded.state.policy_version is None


def test_a_finished_rollout_refuses_its_own_late_reward(guarded: Any) -> None:
    store = guarded.store
    store.transition("r1", RolloutState.RUNNING)
    store.transition("r1", RolloutState.FAILED)
    own = bearer(rollout_token(TOKEN, "r1"))
    late = httpx.post(guarded.url + "/rollouts/r1/reward", json={"reward": 1.0}, headers=own)
    assert late.status_code == 409 and "already failed" in late.json()["error"]["message"]
    assert store.rollout("r1").reward is None
