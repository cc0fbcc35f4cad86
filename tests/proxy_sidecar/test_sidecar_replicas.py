"""Replicas behind one sidecar: each call is labelled with the version of the replica that served
it, and a `k8s://NAMESPACE/SERVICE:PORT` upstream is every address its DNS name lists."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVLLM, ServerThread

from proxy_sidecar.config import SidecarConfig
from proxy_sidecar.discovery.service import ServiceUpstreams, parse_service, resolve_dns
from proxy_sidecar.upstream import UpstreamPool

CHAT = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture
def two() -> Iterator[list[ServerThread]]:
    # Like vLLM, these send no x-harnessrl-policy-version header: the control API's word counts.
    servers = [ServerThread(FakeVLLM(replay=False).app).__enter__() for _ in range(2)]
    yield servers
    for s in servers:
        s.__exit__(None, None, None)


def test_calls_carry_the_version_of_the_replica_that_served_them(
    two: list[ServerThread], make_sidecar: Any
) -> None:
    a, b = (s.url for s in two)
    sc = make_sidecar((a, b))
    control = sc.url + "/control/policy_version"
    assert httpx.post(control, json={"version": 3}).status_code == 200
    # A push that reached replica a only: a serves 4, b still 3.
    r = httpx.post(control, json={"version": 4, "upstream": a + "/v1/"})
    assert r.status_code == 200
    assert r.json()["upstream_versions"] == {a: 4} and r.json()["policy_version"] == 3
    for k in range(16):
        assert httpx.post(sc.base(f"r{k}") + "/chat/completions", json=CHAT).status_code == 200
    calls = [c for k in range(16) for c in sc.store.calls(f"r{k}")]
    assert {c.upstream for c in calls} == {a, b}, "the rollouts spread over both replicas"
    assert all(c.policy_version == (4 if c.upstream == a else 3) for c in calls)
    # Every replica serves 5 now: the per-replica entries are gone.
    r = httpx.post(control, json={"version": 5})
    assert r.json()["upstream_versions"] == {} and r.json()["policy_version"] == 5
    httpx.post(sc.base("later") + "/chat/completions", json=CHAT)
    assert [c.policy_version for c in sc.store.calls("later")] == [5]


def test_a_bad_upstream_in_policy_version_is_refused(make_sidecar: Any, two: Any) -> None:
    sc = make_sidecar((two[0].url,))
    for bad in (7, "vllm-0:8000", ""):
        r = httpx.post(sc.url + "/control/policy_version", json={"version": 1, "upstream": bad})
        assert r.status_code == 400 and "upstream" in r.text
    assert sc.state.upstream_versions == {} and sc.state.policy_version is None


def test_parse_service_names_the_form() -> None:
    svc = parse_service("k8s://harnessrl/vllm:8000")
    assert (svc.namespace, svc.name, svc.port, svc.dns_name) == (
        "harnessrl", "vllm", 8000, "vllm.harnessrl.svc",
    )  # fmt: skip
    assert svc.url("10.0.0.7") == "http://10.0.0.7:8000"
    assert svc.url("fd00::7") == "http://[fd00::7]:8000"
    for bad in ("k8s://vllm:8000", "k8s://harnessrl/vllm", "k8s://ns/svc:http", "http://a/b:1"):
        with pytest.raises(ValueError, match="NAMESPACE/SERVICE:PORT"):
            parse_service(bad)
    assert SidecarConfig(upstreams=("k8s://harnessrl/vllm:8000",)).upstreams == (
        "k8s://harnessrl/vllm:8000",
    )


def test_a_service_upstream_is_every_address_dns_lists_and_follows_it() -> None:
    answers = {"vllm.harnessrl.svc": ["10.0.0.2", "10.0.0.1"]}
    asked: list[tuple[str, int]] = []

    async def resolve(host: str, port: int) -> list[str]:
        asked.append((host, port))
        return answers.get(host, [])

    async def run() -> None:
        pool = UpstreamPool(SidecarConfig(upstreams=("k8s://harnessrl/vllm:8000",)))
        assert pool.upstreams == []  # nothing is called before the lookup
        pool.services = ServiceUpstreams(pool.services.services, refresh_s=0.0, resolve=resolve)
        await pool.start()
        try:
            urls = [u.url for u in pool.upstreams]
            assert urls == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
            pool.eject(pool.upstreams[0])
            answers["vllm.harnessrl.svc"] = ["10.0.0.1", "10.0.0.3"]  # .2 went, .3 came
            assert pool.services.due()
            await pool.refresh()
            assert [u.url for u in pool.upstreams] == [
                "http://10.0.0.1:8000",
                "http://10.0.0.3:8000",
            ]
            assert pool.upstreams[0].failures == 1, "a known replica keeps its ejection"
            answers.clear()  # no ready replica (or DNS down): the last list stays
            await pool.refresh()
            assert len(pool.upstreams) == 2
        finally:
            await pool.close()
        assert asked and all(q == ("vllm.harnessrl.svc", 8000) for q in asked)

    asyncio.run(run())


def test_resolve_dns_asks_the_system_resolver() -> None:
    assert "127.0.0.1" in asyncio.run(resolve_dns("localhost", 80))
    assert asyncio.run(resolve_dns("no-such-service.invalid", 80)) == []
