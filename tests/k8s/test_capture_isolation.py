"""Capture cannot be bypassed on the cluster the manifests describe.

A harness shares its pod's network with its sidecar, so no NetworkPolicy can keep it from what the
sidecar may reach: vLLM's API key is the guard. The shipped vLLM asks every route but /health for
it (k8s/base/vllm_guard.py, since vLLM's own --api-key leaves /invocations and the dev routes
open), only the sidecar containers and the train run get it, and harness containers can read no
Secret at all (no env, envFrom, Secret volume or API token). The NetworkPolicies then keep every
other pod out of vLLM, the store and the sidecars' control port; they are evaluated here on the
rendered base for the pods the launcher and the webhook actually build.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import jsonpatch
import kubernetes_validate
import pytest
import yaml
from guarded_vllm import DEV_ROUTES, GUARD, KEY, GuardedVllm, guard_module
from kubectl_needed import needs_kubectl, require_kubectl

from harnessrl.config import load_config
from harnessrl.fleet.serving import remote_serving
from harnessrl.fleet.weight_sync import WeightSyncError
from harnessrl.pods.k8s import KubernetesLauncherConfig, job_manifest
from harnessrl.rollout.tasks import RunSpec, Task
from harnessrl.stack import pod_sidecar
from proxy_sidecar.inject.webhook import (
    SIDECAR_LABEL,
    SIDECAR_NAME,
    SidecarSpec,
    parse_args,
    review_response,
)

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
SECRETS = ("harnessrl-vllm", "harnessrl-store", "harnessrl-control")
TRAIN_PODS = ("controller/train-job.yaml", "gpu/learner-job.yaml", "gke-tpu/learner-jobset.yaml")


@pytest.fixture
def vllm() -> Any:
    server = GuardedVllm()
    yield server
    server.stop()


def test_the_guard_asks_every_route_but_health_for_the_key(vllm: GuardedVllm) -> None:
    routes = [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/v1/nope")]
    routes += [("POST", p) for p in DEV_ROUTES]
    client = httpx.Client(base_url=vllm.url)
    for method, path in routes:
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = client.request(method, path, headers=auth, json={})
            assert r.status_code == 401, (method, path, auth, r.status_code)
        r = client.request(method, path, headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": "policy", "messages": []})  # fmt: skip
        assert r.status_code != 401, (method, path)
    assert client.get("/health").status_code == 200  # the kubelet's probes
    assert client.post("/health").status_code == 401
    assert {p for p, _ in vllm.calls} == {"/v1/chat/completions", *DEV_ROUTES}


def test_the_guard_refuses_to_start_without_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY"):
        guard_module().RequireKey(lambda *a: None)


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(K8S / overlay)], capture_output=True,
                         text=True, check=True, timeout=120).stdout  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    require_kubectl()
    return render("base")


def test_vllm_runs_the_guard_with_its_key(base: list[dict[str, Any]]) -> None:
    pod = one(base, "StatefulSet", "vllm")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert "--middleware=vllm_guard.RequireKey" in c["args"]
    assert not any(a.startswith("--api-key") for a in c["args"])  # never in the pod spec
    env = {e["name"]: e for e in c["env"]}
    ref = env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("harnessrl-vllm", "api-key")
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert env["PYTHONPATH"]["value"] == mount[volume["name"]]
    cm = one(base, "ConfigMap", volume["configMap"]["name"])
    assert cm["data"]["vllm_guard.py"] == GUARD.read_text()  # what the pods import


def launcher_config(base: list[dict[str, Any]], tmp_path: Path) -> KubernetesLauncherConfig:
    """The harness Jobs' settings as the shipped train config gives them to the launcher (with
    serve.model's tokenizer folder, which is on the share in the cluster)."""
    cm = one(base, "ConfigMap", "harnessrl-train")
    f = tmp_path / "train.yaml"
    f.write_text(cm["data"]["train.yaml"])
    cfg = load_config(f, ["rollout.kubernetes.image=registry.example.com/agent:1",
                          "rollout.store=postgresql://harnessrl@postgres/traces"])  # fmt: skip
    sidecar = dataclasses.replace(pod_sidecar(cfg), tokenizer=cfg.serve.model)
    return dataclasses.replace(cfg.rollout.kubernetes, sidecar=sidecar)


def launcher_pod(base: list[dict[str, Any]], tmp_path: Path) -> dict[str, Any]:
    """A harness Job's pod as the shipped train config makes the launcher build it."""
    launcher = launcher_config(base, tmp_path)
    job = job_manifest(RunSpec("r-1", Task("t", "2+3?"), "g", 0, "", 60.0), launcher)
    template: dict[str, Any] = job["spec"]["template"]
    return template


def webhook_spec(base: list[dict[str, Any]]) -> SidecarSpec:
    """The SidecarSpec the shipped webhook Deployment's flags build."""
    (c,) = one(base, "Deployment", "harnessrl-webhook")["spec"]["template"]["spec"]["containers"]
    return parse_args(c["args"])[1]


RECORDED = ROOT / "tests" / "fixtures" / "admission" / "pod_job_labelled.json"


def injected_pod(base: list[dict[str, Any]], **spec_fields: Any) -> dict[str, Any]:
    """A recorded pod (as the API server sent it: with its API-token volume) after the patch."""
    review = json.loads(RECORDED.read_text())
    pod = review["request"]["object"]
    pod["spec"].update(spec_fields)
    out = review_response(review, webhook_spec(base))["response"]
    assert out["allowed"], out
    patched: dict[str, Any] = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(out["patch"])))
    return patched


def readable_secrets(pod: dict[str, Any], container: dict[str, Any]) -> set[str]:
    """Every Secret (or API token) `container` can read, however it is wired."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    found = {e["secretRef"]["name"] for e in container.get("envFrom", []) if "secretRef" in e}
    for e in container.get("env", []):
        if "secretKeyRef" in e.get("valueFrom", {}):
            found.add(e["valueFrom"]["secretKeyRef"]["name"])
    for m in container.get("volumeMounts", []):
        v = volumes[m["name"]]
        if "secret" in v:
            found.add(v["secret"]["secretName"])
        for s in v.get("projected", {}).get("sources", []):
            found |= {s["secret"]["name"]} if "secret" in s else set()
            found |= {"<api token>"} if "serviceAccountToken" in s else set()
    return found


@needs_kubectl
def test_only_the_sidecar_holds_the_keys(base: list[dict[str, Any]], tmp_path: Path) -> None:
    for pod in (launcher_pod(base, tmp_path), injected_pod(base)):
        spec = pod["spec"]
        (sidecar,) = [c for c in spec["initContainers"] if c["name"] == SIDECAR_NAME]
        assert readable_secrets(pod, sidecar) == set(SECRETS)
        others = [
            c for c in spec.get("initContainers", []) + spec["containers"] if c is not sidecar
        ]
        assert others
        for c in others:
            assert readable_secrets(pod, c) == set(), c["name"]
        assert spec["automountServiceAccountToken"] is False
        assert not spec.get("shareProcessNamespace")  # else /proc/<sidecar>/environ is readable
        assert pod["metadata"]["labels"][SIDECAR_LABEL] == "true"
    sa = one(base, "ServiceAccount", "harnessrl-harness")
    assert sa["automountServiceAccountToken"] is False


def coding_pod(base: list[dict[str, Any]], tmp_path: Path) -> dict[str, Any]:
    """A coding task's Job pod (harnessrl.pods) as the shipped train config's sidecar makes it."""
    from kubernetes import client

    from harnessrl.coding.rollouts import CodingConfig, as_task
    from harnessrl.coding.taskset import load_shipped
    from harnessrl.pods.coding import KubernetesCodingLauncher, coding_job

    config = dataclasses.replace(
        launcher_config(base, tmp_path), image="registry.example.com/harnessrl:1"
    )
    task = load_shipped()[0]
    api = client.ApiClient(client.Configuration(host="http://127.0.0.1:1"))
    coding = CodingConfig(mini_config=str(ROOT / "examples" / "mini.yaml"))
    pods = KubernetesCodingLauncher(
        config, coding, {task.instance_id: task}, model="policy", api_client=api
    )
    spec = RunSpec(f"c-{task.instance_id}", as_task(task), "g", 0, "", 60.0)
    template: dict[str, Any] = coding_job(spec, task, pods, "b")["spec"]["template"]
    return template


@needs_kubectl
def test_every_mount_of_every_harness_pod_names_a_volume_of_the_pod(
    base: list[dict[str, Any]], tmp_path: Path
) -> None:
    """The sidecar's shared-claim mount (its tokenizer folder) survives every pod builder."""
    for pod in (launcher_pod(base, tmp_path), injected_pod(base), coding_pod(base, tmp_path)):
        spec = pod["spec"]
        volumes = {v["name"] for v in spec.get("volumes", [])}
        for c in spec.get("initContainers", []) + spec["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, (pod["metadata"].get("labels"), c["name"], m)
        (sidecar,) = [c for c in spec["initContainers"] if c["name"] == SIDECAR_NAME]
        assert any(m["mountPath"] == "/shared" for m in sidecar["volumeMounts"])
        for c in spec.get("initContainers", []) + spec["containers"]:
            if c is not sidecar:
                assert readable_secrets(pod, c) == set(), c["name"]


@needs_kubectl
@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({"shareProcessNamespace": True}, "shareProcessNamespace"),
        (
            {"volumes": [{"name": "k", "secret": {"secretName": "harnessrl-vllm"}}]},
            "harnessrl-vllm",
        ),
    ],
)
def test_the_webhook_refuses_pods_that_could_read_the_sidecars_keys(
    base: list[dict[str, Any]], change: dict[str, Any], refused: str
) -> None:
    review = json.loads(RECORDED.read_text())
    pod = review["request"]["object"]
    pod["spec"].update(change)
    if "volumes" in change:
        pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "k", "mountPath": "/k"}]
    out = review_response(review, webhook_spec(base))["response"]
    assert out["allowed"] is False and refused in out["status"]["message"], out
    for harness_env in (
        {
            "env": [
                {
                    "name": "K",
                    "valueFrom": {"secretKeyRef": {"name": "harnessrl-store", "key": "url"}},
                }
            ]
        },
        {"envFrom": [{"secretRef": {"name": "harnessrl-control"}}]},
    ):
        review = json.loads(RECORDED.read_text())
        review["request"]["object"]["spec"]["containers"][0].update(harness_env)
        out = review_response(review, webhook_spec(base))["response"]
        assert out["allowed"] is False and "only the capture sidecar" in out["status"]["message"]


@needs_kubectl
def test_the_train_run_holds_vllms_key_for_weight_sync(
    base: list[dict[str, Any]], vllm: GuardedVllm, tmp_path: Path
) -> None:
    """Each train pod's args (as Kubernetes expands them) give the loop vLLM's key, and weight
    sync through the guard works with it and fails without it."""
    cm = one(base, "ConfigMap", "harnessrl-train")
    f = tmp_path / "train.yaml"
    f.write_text(cm["data"]["train.yaml"])
    for path in TRAIN_PODS:
        (doc,) = yaml.safe_load_all((K8S / path).read_text())
        pod = doc["spec"]["template"] if doc["kind"] == "Job" else (
            doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"])  # fmt: skip
        (c,) = pod["spec"]["containers"]
        env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in c["env"]}
        assert env["HARNESSRL_VLLM_API_KEY"] == {"name": "harnessrl-vllm", "key": "api-key"}
        values = {"HARNESSRL_VLLM_API_KEY": KEY, "HARNESSRL_STORE_URL": "postgresql://h@p/t",
                  "HARNESSRL_IMAGE": "registry.example.com/harnessrl:1"}  # fmt: skip
        args = [a.replace("/etc/harnessrl/train.yaml", str(f)) for a in c["args"]]
        for name, value in values.items():
            args = [a.replace(f"$({name})", value) for a in args]
        assert load_config(None, args).serve.admin_token == KEY, path
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    (export / "model.safetensors").write_bytes(b"")
    with_key = remote_serving(vllm.url, "vllm", tmp_path / "w", None, KEY)
    with_key.sync.push(export, 3)
    body = dict(vllm.calls)["/update_weight_version"]
    assert body == {"new_version": "3"}
    without = remote_serving(vllm.url, "vllm", tmp_path / "w", None, "")
    with pytest.raises(WeightSyncError, match="401"):
        without.sync.push(export, 4)


# --- NetworkPolicies, evaluated for the pods the launcher and the webhook build ---


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # what this evaluator understands
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def admits(policies: list[dict[str, Any]], target: dict[str, str], source: dict[str, str],
           port: int, protocol: str = "TCP") -> bool:  # fmt: skip
    """Whether a pod labelled `source` reaches `port` of a pod labelled `target` (both in the
    namespace of the policies), by the NetworkPolicy rules: no ingress policy selecting the
    target admits all; otherwise some rule of one of them must admit source and port."""
    mine = [p["spec"] for p in policies if selects(p["spec"]["podSelector"], target)
            and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]  # fmt: skip
    if not mine:
        return True
    for spec in mine:
        for rule in spec.get("ingress", []):
            peers = rule.get("from")
            if peers:
                assert all(set(p) == {"podSelector"} for p in peers), peers
            ok_from = not peers or any(selects(p["podSelector"], source) for p in peers)
            ok_port = not rule.get("ports") or any(
                r.get("protocol", "TCP") == protocol
                and r["port"] <= port <= r.get("endPort", r["port"])
                for r in rule["ports"]
            )
            if ok_from and ok_port:
                return True
    return False


@needs_kubectl
def test_network_policies_admit_only_who_needs_each_port(
    base: list[dict[str, Any]], tmp_path: Path
) -> None:
    policies = [d for d in base if d["kind"] == "NetworkPolicy"]
    for p in policies:
        kubernetes_validate.validate(p, "1.33", strict=True)
    job = launcher_pod(base, tmp_path)["metadata"]["labels"]
    injected = injected_pod(base)["metadata"]["labels"]
    coding = {**job, "harnessrl.io/sandbox": "coding"}
    train = {"app.kubernetes.io/name": "harnessrl-train"}
    vllm = one(base, "StatefulSet", "vllm")["spec"]["template"]["metadata"]["labels"]
    postgres = one(base, "StatefulSet", "postgres")["spec"]["template"]["metadata"]["labels"]
    hook = one(base, "Deployment", "harnessrl-webhook")["spec"]["template"]["metadata"]["labels"]
    stranger = {"app": "something-else"}
    for sidecar_pod in (job, injected, coding):
        assert admits(policies, vllm, sidecar_pod, 8000)
        assert admits(policies, postgres, sidecar_pod, 5432)
    assert admits(policies, vllm, train, 8000) and admits(policies, postgres, train, 5432)
    for other in (stranger, hook, postgres):
        assert not admits(policies, vllm, other, 8000), other
    for other in (stranger, hook, vllm):
        assert not admits(policies, postgres, other, 5432), other
    # The sidecars' control port: the train run only, never another run's harness.
    for sidecar_pod in (job, injected, coding):
        assert admits(policies, sidecar_pod, train, 8080)
        for other in (job, injected, stranger):
            assert not admits(policies, sidecar_pod, other, 8080), (sidecar_pod, other)
    # Harness Jobs and coding sandboxes take nothing else; your injected pods keep other ports.
    assert not admits(policies, job, stranger, 3000)
    assert not admits(policies, coding, stranger, 3000)
    assert admits(policies, injected, stranger, 3000) and admits(
        policies, injected, stranger, 53, "UDP"
    )
