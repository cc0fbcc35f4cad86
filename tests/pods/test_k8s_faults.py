"""KubernetesLauncher against an API server that misbehaves as real ones do (tests/k8s/fake_apiserver.py):
refused connections, watches cut mid-chunk, answers lost or late, 409 on a retried create, 429 with
Retry-After, 500s; and a fake that refuses bodies off the Kubernetes 1.33 schema.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client

from harnessrl.pods.k8s import (
    KubernetesLauncher,
    KubernetesLauncherConfig,
    job_manifest,
    job_name,
)
from harnessrl.pods.k8s_api import retry_after_s, retry_delay
from harnessrl.rollout.tasks import RunSpec, Task
from harnessrl.traces.schema import RolloutState
from proxy_sidecar.inject.webhook import SidecarSpec

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "fake_apiserver", ROOT / "tests/k8s/fake_apiserver.py"
)
assert _spec and _spec.loader
fake = importlib.util.module_from_spec(_spec)
sys.modules["fake_apiserver"] = fake
_spec.loader.exec_module(fake)

CFG = KubernetesLauncherConfig(
    image="registry.example.com/harness:1.0",
    command=("python", "-m", "harness", "--task", "{task_file}"),
    sidecar=SidecarSpec(image="registry.example.com/harnessrl:0.1.0", upstream="http://vllm:8000"),
    creates_per_s=200.0,
    watch_timeout_s=2,
    deadline_grace_s=0.5,
    request_timeout_s=0.5,
)


def spec(i: int, timeout_s: float = 30.0) -> RunSpec:
    t = Task("sum-3", "What is 1+2? Answer with just the number.", "3")
    return RunSpec(f"step0-sum-3-{i}", t, "g-sum-3", i, "http://sidecar/rollouts/x/v1", timeout_s)


def launcher(kube: Any, cls: type[KubernetesLauncher] = KubernetesLauncher) -> KubernetesLauncher:
    api = client.ApiClient(client.Configuration(host=kube.url))
    return cls(CFG, api_client=api)


def completes(after_s: float = 0.05) -> Any:
    return lambda job: fake.Outcome("complete", after_s, log="3\n")


def succeeded(results: list[Any]) -> bool:
    return all(r.state is RolloutState.SUCCEEDED and r.output == "3" for r in results)


def test_fake_refuses_a_body_off_the_schema_with_422() -> None:
    """Raw HTTP, as any client may send it (the official one checks some fields itself)."""
    good = job_manifest(spec(0), CFG)
    misspelled = job_manifest(spec(1), CFG)
    pod = misspelled["spec"]["template"]["spec"]
    pod["containerz"] = pod.pop("containers")
    wrong_type = job_manifest(spec(2), CFG)
    wrong_type["spec"]["backoffLimit"] = "zero"
    with fake.FakeKube(completes()) as kube:
        url = f"{kube.url}/apis/batch/v1/namespaces/harnessrl/jobs"
        for body, field in ((misspelled, "containerz"), (wrong_type, "backoffLimit")):
            r = httpx.post(url, json=body)
            assert r.status_code == 422 and r.json()["reason"] == "Invalid", r.text
            assert field in r.json()["message"]
        assert kube.jobs == {}
        assert httpx.post(url, json=good).status_code == 201
        # What the launcher sends passes, and asks a real server to refuse unknown fields too.
        assert succeeded(launcher(kube).run([spec(3)]))
        assert any(
            "fieldValidation=Strict" in path for _, r, path in kube.requests if r == "create"
        )


def test_refused_connections_mid_round_lose_no_run() -> None:
    """A control-plane upgrade: nothing listens for 2 s while the Jobs run on."""
    specs = [spec(i) for i in range(3)]
    with fake.FakeKube(completes(1.0)) as kube:
        threading.Timer(0.3, kube.refuse, (2.0,)).start()
        t0 = time.monotonic()
        results = launcher(kube).run(specs)
        assert time.monotonic() - t0 >= 2.0  # it really waited the outage out
        assert succeeded(results), [r.stderr for r in results]
        assert sorted(kube.deleted) == sorted(job_name(s.rollout_id) for s in specs)
        assert any(t > kube.refused_until for t, r, _ in kube.requests if r == "list")


def test_refused_connection_at_create_is_retried() -> None:
    with fake.FakeKube(completes()) as kube:
        kube.inject("create", fake.Fault("refuse", seconds=1.0))
        (result,) = launcher(kube).run([spec(0)])
        assert result.state is RolloutState.SUCCEEDED, result.stderr
        assert len(kube.created) == 1


def test_watch_cut_mid_chunk_is_watched_again() -> None:
    def staggered(job: dict[str, Any]) -> Any:  # a second watch is still needed after the first
        late = job["metadata"]["name"] == job_name(spec(1).rollout_id)
        return fake.Outcome("complete", 3.0 if late else 0.5, log="3\n")

    with fake.FakeKube(staggered) as kube:
        kube.inject("watch", fake.Fault("cut"), fake.Fault("cut"))
        results = launcher(kube).run([spec(0), spec(1)])
        assert succeeded(results), [r.stderr for r in results]
        assert not kube.faults["watch"]  # both cuts happened


@pytest.mark.parametrize("lost", ["late", "lost"])
def test_create_whose_answer_was_lost_adopts_its_job_on_409(lost: str) -> None:
    """The Job was created, the answer came too late (or never): the retry's 409 means this run's
    own Job, which is watched, collected and deleted like any other."""
    with fake.FakeKube(completes(0.3)) as kube:
        kube.inject("create", fake.Fault(lost, seconds=1.5))
        (result,) = launcher(kube).run([spec(0)])
        assert result.state is RolloutState.SUCCEEDED, result.stderr
        assert len(kube.created) == 1
        assert [r for _, r, _ in kube.requests].count("create") == 2  # the retry got 409
        assert kube.deleted == [job_name(spec(0).rollout_id)] and kube.jobs == {}


def test_a_job_of_another_launch_is_not_adopted() -> None:
    with fake.FakeKube(lambda job: fake.Outcome("hang")) as kube:
        code, _ = kube.create_job("harnessrl", job_manifest(spec(0), CFG, batch="earlier"))
        assert code == 201
        (result,) = launcher(kube).run([spec(0)])
        assert result.state is RolloutState.FAILED
        assert "already exists from another launch" in result.stderr
        assert "kubectl delete job -n harnessrl" in result.stderr
        assert kube.deleted == [] and job_name(spec(0).rollout_id) in kube.jobs  # not ours


def test_429_waits_as_long_as_retry_after_says() -> None:
    with fake.FakeKube(completes()) as kube:
        kube.inject("create", fake.Fault("status", 429, retry_after="1"))
        (result,) = launcher(kube).run([spec(0)])
        assert result.state is RolloutState.SUCCEEDED, result.stderr
        creates = [t for t, r, _ in kube.requests if r == "create"]
        assert len(creates) == 2 and creates[1] - creates[0] >= 1.0


def test_500s_on_every_call_are_retried() -> None:
    status = fake.Fault("status", 500, retry_after="0")
    with fake.FakeKube(completes(0.3)) as kube:
        for route in ("create", "list", "watch", "pods", "log"):
            kube.inject(route, status, status)
        results = launcher(kube).run([spec(0), spec(1)])
        assert succeeded(results), [r.stderr for r in results]


def test_a_run_whose_log_cannot_be_read_is_failed_not_trained_on_empty_output() -> None:
    status = fake.Fault("status", 500, retry_after="0")
    with fake.FakeKube(completes()) as kube:
        kube.inject("log", *[status] * 4)  # every try of the one run's log read
        (result,) = launcher(kube).run([spec(0)])
        assert result.state is RolloutState.FAILED and "could not read the pod" in result.stderr
        assert kube.jobs == {}


def test_create_given_up_after_a_lost_answer_deletes_the_name() -> None:
    """The first try may have created the Job: a run reported FAILED leaves nothing running."""
    busy = fake.Fault("status", 503, retry_after="0")
    with fake.FakeKube(lambda job: fake.Outcome("hang")) as kube:
        kube.inject("create", fake.Fault("lost"), *[busy] * 5)
        (result,) = launcher(kube).run([spec(0)])
        assert result.state is RolloutState.FAILED and "503" in result.stderr
        assert len(kube.created) == 1 and kube.jobs == {}
        assert kube.deleted == [job_name(spec(0).rollout_id)]


def test_interrupt_still_deletes_live_jobs() -> None:
    with fake.FakeKube(lambda job: fake.Outcome("hang")) as kube:
        lz = launcher(kube)
        original = lz._batch.list_namespaced_job

        def interrupt(*a: Any, **kw: Any) -> Any:
            if kube.jobs:
                raise KeyboardInterrupt
            return original(*a, **kw)

        lz._batch.list_namespaced_job = interrupt
        with pytest.raises(KeyboardInterrupt):
            lz.run([spec(0)])
        assert kube.deleted == [job_name(spec(0).rollout_id)]


def test_retry_after_forms() -> None:
    class Err:
        def __init__(self, value: str) -> None:
            self.headers = {"Retry-After": value}

    assert retry_after_s(Err("3")) == 3.0
    assert retry_after_s(Err("9999")) == 60.0  # capped
    assert retry_after_s(Err("Wed, 21 Oct 2015 07:28:00 GMT")) == 0.0  # a date in the past
    assert retry_after_s(Err("soon")) is None and retry_after_s(None) is None
    assert retry_delay(None, 2) == pytest.approx(0.8)
