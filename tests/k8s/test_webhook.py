"""Injection webhook on recorded AdmissionReview v1 requests: patch applied, pod spec asserted."""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
from pod_patch import apply_patch
from starlette.testclient import TestClient

from proxy_sidecar.inject.webhook import (
    SIDECAR_NAME,
    SidecarSpec,
    create_app,
    review_response,
)

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "admission"
SPEC = SidecarSpec(image="registry.example.com/harnessrl:0.1.0", upstream="http://vllm:8000")


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def mutate(review: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    out = review_response(review, SPEC)
    assert out["apiVersion"] == "admission.k8s.io/v1" and out["kind"] == "AdmissionReview"
    resp = out["response"]
    assert resp["uid"] == review["request"]["uid"]
    if "patch" not in resp:
        return resp, []
    assert resp["patchType"] == "JSONPatch"
    return resp, json.loads(base64.b64decode(resp["patch"]))


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_job_pod_gets_native_sidecar_and_env() -> None:
    review = load("pod_job_labelled.json")
    resp, ops = mutate(review)
    assert resp["allowed"] is True and ops
    pod = apply_patch(review["request"]["object"], ops)
    inits = pod["spec"]["initContainers"]
    assert [c["name"] for c in inits] == [SIDECAR_NAME]
    sidecar = inits[0]
    assert sidecar["restartPolicy"] == "Always"  # native sidecar
    assert sidecar["image"] == SPEC.image
    assert sidecar["args"][:2] == ["--upstream", "http://vllm:8000"]
    assert sidecar["startupProbe"]["tcpSocket"]["port"] == SPEC.port
    sidecar_env = {e["name"]: e for e in sidecar["env"]}
    assert (
        sidecar_env["HARNESSRL_STORE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "harnessrl-store"
    )
    env = env_of(pod["spec"]["containers"][0])
    assert env == {
        "AGENT_MAX_TURNS": "30",
        "OPENAI_BASE_URL": f"http://127.0.0.1:{SPEC.port}/v1",
        "OPENAI_API_KEY": SPEC.api_key,
    }
    assert pod["metadata"]["annotations"]["harnessrl.io/injected"] == SIDECAR_NAME
    assert pod["metadata"]["annotations"]["harnessrl.io/rollout-id"] == "eval-0001"
    # Everything but the injection is unchanged, except the API token the ServiceAccount
    # plugin mounted before the webhook ran: the harness must not read Secrets through the API.
    before = review["request"]["object"]
    kept = [v for v in before["spec"]["volumes"] if not v["name"].startswith("kube-api-access-")]
    assert len(kept) == len(before["spec"]["volumes"]) - 1
    assert pod["spec"]["volumes"] == kept
    assert not any(
        m["name"].startswith("kube-api-access-")
        for c in pod["spec"]["containers"] + inits
        for m in c.get("volumeMounts", [])
    )
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["metadata"]["labels"]["harnessrl.io/sidecar"] == "true"  # what the policies select
    assert pod["spec"]["containers"][0]["command"] == before["spec"]["containers"][0]["command"]
    kubernetes_validate.validate(pod, "1.33", strict=True)


def test_existing_init_containers_and_env_are_kept() -> None:
    review = load("pod_labelled_with_init.json")
    _, ops = mutate(review)
    pod = apply_patch(review["request"]["object"], ops)
    assert [c["name"] for c in pod["spec"]["initContainers"]] == [SIDECAR_NAME, "fetch-repo"]
    sidecar_env = {e["name"]: e for e in pod["spec"]["initContainers"][0]["env"]}
    # No rollout-id annotation: the pod is its own rollout, named after the pod.
    assert (
        sidecar_env["HARNESSRL_ROLLOUT_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    )
    coder, tools = pod["spec"]["containers"]
    coder_env = env_of(coder)
    assert coder_env["OPENAI_BASE_URL"] == f"http://127.0.0.1:{SPEC.port}/v1"  # redirected
    assert coder_env["OPENAI_API_KEY"] == {"secretKeyRef": {"name": "coder-keys", "key": "openai"}}
    assert coder_env["CODER_WORKDIR"] == "/work"
    assert [e["name"] for e in coder["env"]] == [
        "OPENAI_BASE_URL",
        "OPENAI_API_KEY",
        "CODER_WORKDIR",
    ]
    assert env_of(tools)["OPENAI_BASE_URL"] == f"http://127.0.0.1:{SPEC.port}/v1"
    kubernetes_validate.validate(pod, "1.33", strict=True)


@pytest.mark.parametrize("name", ["pod_job_labelled.json", "pod_labelled_with_init.json"])
def test_second_invocation_changes_nothing(name: str) -> None:
    review = load(name)
    _, ops = mutate(review)
    patched = apply_patch(review["request"]["object"], ops)
    again = copy.deepcopy(review)
    again["request"]["object"] = patched
    resp, ops2 = mutate(again)
    assert resp["allowed"] is True
    assert ops2 == [] and "patch" not in resp


@pytest.mark.parametrize(
    "name", ["pod_unlabelled.json", "pod_label_false.json", "deployment_labelled.json"]
)
def test_pods_not_owned_are_untouched(name: str) -> None:
    resp, ops = mutate(load(name))
    assert resp == {"uid": load(name)["request"]["uid"], "allowed": True}
    assert ops == []


def test_owned_pod_that_cannot_be_injected_is_refused_with_reason() -> None:
    review = load("pod_job_labelled.json")
    review["request"]["object"]["spec"]["initContainers"] = "not-a-list"
    resp, ops = mutate(review)
    assert resp["allowed"] is False and ops == []
    assert "initContainers" in resp["status"]["message"]


def test_malformed_reviews_get_400_and_bad_spec_raises() -> None:
    client = TestClient(create_app(SPEC))
    assert client.post("/mutate", content=b"{not json").status_code == 400
    r = client.post(
        "/mutate", json={"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}
    )
    assert r.status_code == 400 and "admission.k8s.io/v1" in r.json()["error"]
    assert (
        client.post(
            "/mutate", json={"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1"}
        ).status_code
        == 400
    )
    ok = client.post("/mutate", json=load("pod_job_labelled.json"))
    assert ok.status_code == 200 and ok.json()["response"]["patchType"] == "JSONPatch"
    with pytest.raises(ValueError, match="upstream"):
        SidecarSpec(upstream="vllm:8000")
    with pytest.raises(ValueError, match="port"):
        SidecarSpec(port=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a cert")
def test_webhook_serves_over_tls(tmp_path: Path) -> None:
    key, cert = tmp_path / "tls.key", tmp_path / "tls.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    port = _free_port()
    ctx = ssl.create_default_context(cafile=str(cert))
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy_sidecar.inject.webhook", "--host", "127.0.0.1",
         "--port", str(port), "--tls-cert", str(cert), "--tls-key", str(key)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"https://127.0.0.1:{port}/healthz", verify=ctx, timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
                assert time.monotonic() < deadline, "webhook did not come up over TLS"
                time.sleep(0.3)
        assert r.text == "ok"
        review = load("pod_job_labelled.json")
        r = httpx.post(f"https://127.0.0.1:{port}/mutate", json=review, verify=ctx)
        ops = json.loads(base64.b64decode(r.json()["response"]["patch"]))
        assert any(op["path"] == "/spec/initContainers" for op in ops)
        # The bounded listener of the other servers: an oversized head is refused.
        huge = httpx.get(
            f"https://127.0.0.1:{port}/healthz", headers={"x-pad": "a" * 100_000}, verify=ctx
        )
        assert huge.status_code == 431
        with pytest.raises(httpx.TransportError):  # plain HTTP is not served
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_main_builds_the_spec_from_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    from proxy_sidecar.inject import webhook

    seen: dict[str, Any] = {}

    def fake_run(server: uvicorn.Server) -> None:
        c = server.config
        seen.update(
            ssl_certfile=c.ssl_certfile,
            ssl_keyfile=c.ssl_keyfile,
            port=c.port,
            spec=c.app.state.spec,
        )

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    webhook.main(
        ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--port", "9443",
         "--sidecar-image", "reg/x:1", "--upstream", "http://a:1,http://b:2", "--sidecar-port", "9090"]
    )  # fmt: skip
    assert (
        seen["ssl_certfile"] == "c.pem" and seen["ssl_keyfile"] == "k.pem" and seen["port"] == 9443
    )
    assert seen["spec"] == SidecarSpec(image="reg/x:1", upstream="http://a:1,http://b:2", port=9090)


def test_a_tokenizer_folder_must_be_on_the_sidecars_shared_claim() -> None:
    for bad in ({"tokenizer": "/models/base"},
                {"tokenizer": "/models/base", "shared_claim": "harnessrl-shared"}):  # fmt: skip
        with pytest.raises(ValueError, match="shared_claim to the PVC"):
            SidecarSpec(**bad)
    spec = SidecarSpec(tokenizer="/shared/models/base", shared_claim="harnessrl-shared")
    assert SidecarSpec(tokenizer="smollm2").sees("smollm2")  # a name: nothing to mount
    review = load("pod_job_labelled.json")
    out = review_response(review, spec)["response"]
    pod = apply_patch(review["request"]["object"], json.loads(base64.b64decode(out["patch"])))
    (sidecar,) = pod["spec"]["initContainers"]
    assert sidecar["args"][-2:] == ["--tokenizer", "/shared/models/base"]
    (mount,) = sidecar["volumeMounts"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert mount["readOnly"] and volume["persistentVolumeClaim"] == {
        "claimName": "harnessrl-shared", "readOnly": True}  # fmt: skip
    assert not any(c.get("volumeMounts") for c in pod["spec"]["containers"])  # the harness: none
    again = review_response({**review, "request": {**review["request"], "object": pod}}, spec)
    assert "patch" not in again["response"]  # reinvocation adds nothing twice
