"""A push that reached some replicas only: the pods' sidecars learn which replicas serve the new
version (so those calls are not labelled with the old one), and no new version is recorded."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from harnessrl.fleet.capture import PodCapture
from harnessrl.fleet.weight_sync import WeightSyncError
from proxy_sidecar.inject.webhook import SidecarSpec


class Pods:
    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.policy_version: int | None = 4
        self.config = SimpleNamespace(sidecar=SidecarSpec(port=8080))

    def sidecar_urls(self) -> list[str]:
        return self.urls


def test_sidecars_hear_which_replicas_took_a_failed_push() -> None:
    seen: list[tuple[str, str, dict[str, object]]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        seen.append((request.url.host, request.url.path.rsplit("/", 1)[1], body))
        return httpx.Response(200, json={})

    pods = Pods(["http://10.0.0.2:8080", "http://10.0.0.3:8080"])
    client = httpx.Client(transport=httpx.MockTransport(handle))
    cap = PodCapture(pods, "secret", client=client)
    updated = {"http://10.1.0.7:8000": 5}
    with pytest.raises(WeightSyncError, match="1 of 2"), cap.hold(5):
        raise WeightSyncError("1 of 2 servers did not take version 5", updated)
    assert pods.policy_version == 4, "new Jobs keep the last version every replica serves"
    told = [(h, b) for h, action, b in seen if action == "policy_version"]
    assert told == [
        ("10.0.0.2", {"version": 5, "upstream": "http://10.1.0.7:8000"}),
        ("10.0.0.3", {"version": 5, "upstream": "http://10.1.0.7:8000"}),
    ]
    assert [a for _, a, _ in seen][-2:] == ["resume", "resume"]
