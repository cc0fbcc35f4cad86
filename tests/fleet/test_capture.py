"""Who holds calls during a push: the pods' sidecars (PodCapture), with pods coming and going."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from harnessrl.fleet.capture import HoldFailed, PodCapture
from proxy_sidecar.inject.webhook import SidecarSpec


class Pods:
    """Stands in for KubernetesLauncher: the sidecar urls of the pods in flight."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.policy_version: int | None = None
        self.config = SimpleNamespace(sidecar=SidecarSpec(port=8080))

    def sidecar_urls(self) -> list[str]:
        return self.urls


def capture(pods: Pods, answer: Any) -> tuple[PodCapture, list[tuple[str, str]]]:
    seen: list[tuple[str, str]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer secret"
        host, action = request.url.host, request.url.path.rsplit("/", 1)[1]
        seen.append((host, action))
        return answer(host, action)

    client = httpx.Client(
        transport=httpx.MockTransport(handle), headers={"Authorization": "Bearer secret"}
    )
    return PodCapture(pods, "secret", client=client), seen


def test_pauses_every_pod_then_sets_the_version_and_resumes() -> None:
    pods = Pods(["http://10.0.0.2:8080", "http://10.0.0.3:8080", "http://10.0.0.2:8080"])
    cap, seen = capture(pods, lambda host, action: httpx.Response(200, json={}))
    with cap.hold(3):
        assert seen == [("10.0.0.2", "pause"), ("10.0.0.3", "pause")]
    assert pods.policy_version == 3  # Jobs created from now on start at the new version
    assert seen[2:] == [
        ("10.0.0.2", "policy_version"),
        ("10.0.0.3", "policy_version"),
        ("10.0.0.2", "resume"),
        ("10.0.0.3", "resume"),
    ]
    assert cap.base_url("r1") == "http://127.0.0.1:8080/rollouts/r1/v1"


def test_a_finished_pod_is_skipped_and_a_failed_push_changes_no_version() -> None:
    def answer(host: str, action: str) -> httpx.Response:
        if host == "10.0.0.9":
            raise httpx.ConnectError("connection refused")  # the run ended meanwhile
        return httpx.Response(200, json={})

    pods = Pods(["http://10.0.0.2:8080", "http://10.0.0.9:8080"])
    cap, seen = capture(pods, answer)
    with pytest.raises(RuntimeError, match="push failed"), cap.hold(5):
        raise RuntimeError("push failed")
    assert pods.policy_version is None
    assert seen == [("10.0.0.2", "pause"), ("10.0.0.9", "pause"), ("10.0.0.2", "resume")]


def test_a_sidecar_refusing_to_pause_stops_the_push_and_resumes_the_others() -> None:
    def answer(host: str, action: str) -> httpx.Response:
        if host == "10.0.0.3":
            return httpx.Response(401, text="bad token")
        return httpx.Response(200, json={})

    pods = Pods(["http://10.0.0.2:8080", "http://10.0.0.3:8080"])
    cap, seen = capture(pods, answer)
    refused = pytest.raises(RuntimeError, match=r"10.0.0.3:8080/control/pause answered 401")
    with refused, cap.hold(1):
        pytest.fail("the push must not run while a sidecar is not paused")
    assert seen[-1] == ("10.0.0.2", "resume") and pods.policy_version is None


def test_missing_control_token_says_where_it_comes_from() -> None:
    with pytest.raises(ValueError, match=r"HARNESSRL_CONTROL_TOKEN.*harnessrl-control"):
        PodCapture(Pods([]), "")


def test_a_pods_reward_credential_is_what_its_sidecar_accepts_for_that_rollout_only() -> None:
    from proxy_sidecar.control import authorize
    from proxy_sidecar.errors import Unauthorized

    url, token = PodCapture(Pods([]), "secret").reward_credential("s1-g0-r1")
    assert url == "http://127.0.0.1:8080/rollouts/s1-g0-r1/reward"  # the pod's own sidecar
    scope = {"headers": [(b"authorization", f"Bearer {token}".encode())]}
    assert authorize(scope, "secret", "s1-g0-r1") == "rollout"  # the pod sidecar's check
    for rollout_id, control_token in (("s1-g0-r0", "secret"), ("s1-g0-r1", "other")):
        with pytest.raises(Unauthorized):
            authorize(scope, control_token, rollout_id)
    with pytest.raises(Unauthorized):
        authorize(scope, "secret")  # not a control token


def test_the_reward_credential_reaches_the_harness_container_of_a_job() -> None:
    from harnessrl.pods.k8s import HARNESS_CONTAINER, KubernetesLauncherConfig, job_manifest
    from harnessrl.rollout.round import plan_round
    from harnessrl.rollout.tasks import Task

    cfg = KubernetesLauncherConfig(
        image="registry.example.com/harness:1.0",
        command=("python", "-m", "harness"),
        sidecar=SidecarSpec(upstream="http://vllm:8000"),
    )
    pods = Pods([])
    pods.config = SimpleNamespace(sidecar=cfg.sidecar)
    pod_capture = PodCapture(pods, "secret")
    [spec] = plan_round(
        [Task("t", "p")],
        prefix="s0",
        runs_per_task=1,
        base_url=pod_capture.base_url,
        timeout_s=10.0,
        reward=pod_capture.reward_credential,
    )
    pod = job_manifest(spec, cfg)["spec"]["template"]["spec"]
    [harness] = [c for c in pod["containers"] if c["name"] == HARNESS_CONTAINER]
    env = {e["name"]: e["value"] for e in harness["env"]}
    assert (env["HARNESSRL_REWARD_URL"], env["HARNESSRL_REWARD_TOKEN"]) == (
        pod_capture.reward_credential("s0-g0-r0")
    )
    assert env["HARNESSRL_REWARD_URL"].startswith(f"http://127.0.0.1:{cfg.sidecar.port}/")
    assert "secret" not in env.values() and "HARNESSRL_CONTROL_TOKEN" not in env


def test_a_pod_that_cannot_drain_fails_the_push_naming_it_and_its_calls_in_flight() -> None:
    def answer(host: str, action: str) -> httpx.Response:
        if host == "10.0.0.3" and action == "pause":  # the sidecar's answer to a failed drain
            message = "2 call(s) still in flight after drain_timeout_s=120; not paused"
            return httpx.Response(409, json={"error": {"message": message}})
        return httpx.Response(200, json={})

    pods = Pods(["http://10.0.0.2:8080", "http://10.0.0.3:8080", "http://10.0.0.4:8080"])
    cap, seen = capture(pods, answer)
    failed = pytest.raises(HoldFailed, match=r"version 6 not made: sidecar http://10\.0\.0\.3:8080")
    with failed as err, cap.hold(6):
        pytest.fail("the push must not run while a sidecar still has calls in flight")
    assert "2 call(s) still in flight" in str(err.value)
    assert seen == [("10.0.0.2", "pause"), ("10.0.0.3", "pause"), ("10.0.0.2", "resume")]
    assert pods.policy_version is None


def test_eval_runs_start_their_pod_sidecars_in_eval_mode() -> None:
    from harnessrl.pods.k8s import KubernetesLauncherConfig, job_manifest
    from harnessrl.rollout.round import plan_round
    from harnessrl.rollout.tasks import Task

    pods = Pods([])
    pods.sidecar_mode = "train"
    cap = PodCapture(pods, "secret")
    cfg = KubernetesLauncherConfig(image="harness:1", command=("h",), sidecar=SidecarSpec())
    [spec] = plan_round([Task("t", "p")], prefix="e0", runs_per_task=1,
                        base_url=cap.base_url, timeout_s=10.0)  # fmt: skip

    def sidecar_args() -> list[str]:
        pod = job_manifest(spec, cfg, "b", None, pods.sidecar_mode)["spec"]["template"]["spec"]
        return list(pod["initContainers"][0]["args"])

    assert "--mode" not in sidecar_args()
    with cap.evaluating():
        args = sidecar_args()
        assert args[args.index("--mode") + 1] == "eval"
    assert pods.sidecar_mode == "train" and "--mode" not in sidecar_args()
