"""The weight-swap hold drains or fails: a call still in flight past the drain timeout refuses the
pause (409, new calls resumed), and the train loop's capture raises instead of swapping."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from harnessrl.fleet.capture import HoldFailed, LocalCapture
from harnessrl.fleet.sidecar import SidecarProcess
from proxy_sidecar.config import SidecarConfig

CHAT = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def slow_call(base: str) -> threading.Thread:
    """A harness call that the upstream answers only after its delay."""
    worker = threading.Thread(
        target=lambda: httpx.post(base + "/chat/completions", json=CHAT, timeout=30)
    )
    worker.start()
    return worker


def wait_until(cond: Callable[[], bool], worker: threading.Thread) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert worker.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)


def test_a_swap_over_a_call_in_flight_is_refused_and_the_call_keeps_its_version(
    fake: Any, sidecar: Any
) -> None:
    """The attack: a call held in flight past the drain timeout, then the loop's swap sequence.
    Before, the pause answered 200 anyway, the version moved, and the call (sampled under the
    old weights) was recorded under the new one."""
    fake[0].delay_s = 1.5
    url = sidecar.url
    assert httpx.post(url + "/control/policy_version", json={"version": 1}).status_code == 200
    worker = slow_call(sidecar.base("held"))
    wait_until(lambda: sidecar.state.in_flight == 1, worker)
    r = httpx.post(url + "/control/pause", json={"drain_timeout_s": 0.2}, timeout=10)
    swapped = r.status_code == 200
    if swapped:  # what the train loop did next
        httpx.post(url + "/control/policy_version", json={"version": 2})
        httpx.post(url + "/control/resume")
    worker.join(30)
    fake[0].delay_s = 0.0
    [call] = sidecar.store.calls("held")
    assert call.policy_version == 1, "a call sampled under version 1 was recorded as version 2"
    assert not swapped and r.status_code == 409
    error = r.json()["error"]
    assert error["type"] == "conflict_error"
    assert "1 call(s) still in flight after drain_timeout_s=0.2" in error["message"]
    status = httpx.get(url + "/control/status").json()
    assert status["paused"] is False and status["policy_version"] == 1  # not half-applied
    assert httpx.post(sidecar.base("next") + "/chat/completions", json=CHAT).status_code == 200


def test_a_bad_drain_timeout_leaves_the_sidecar_unpaused(sidecar: Any) -> None:
    r = httpx.post(sidecar.url + "/control/pause", json={"drain_timeout_s": -1})
    assert r.status_code == 400
    assert httpx.get(sidecar.url + "/control/status").json()["paused"] is False


def test_the_loops_hold_raises_naming_the_sidecar_and_its_calls_in_flight(
    fake: Any, tmp_path: Path
) -> None:
    cfg = SidecarConfig(
        upstreams=(fake[1].url,), store=f"sqlite:///{tmp_path / 'traces.db'}", port=0,
        log_calls=False, policy_version=1,
    )  # fmt: skip
    proc = SidecarProcess(cfg, tmp_path / "sidecar.log")
    capture = LocalCapture(proc, drain_timeout_s=0.3)
    pushed: list[int] = []
    try:
        fake[0].delay_s = 2.0
        worker = slow_call(proc.base_url("held"))
        wait_until(lambda: proc.status()["in_flight"] == 1, worker)
        with pytest.raises(HoldFailed) as err, capture.hold(2):
            pushed.append(2)
        assert pushed == []  # the push never ran
        message = str(err.value)
        assert proc.url in message and "1 call(s) still in flight" in message
        assert "policy version 2 not made" in message
        status = proc.status()
        assert status["paused"] is False and status["policy_version"] == 1
        worker.join(30)
    finally:
        fake[0].delay_s = 0.0
        proc.stop()
