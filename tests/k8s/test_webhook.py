"""Injection webhook on recorded AdmissionReview v1 requests: patch applied, pod spec asserted."""

from __future__ import annotations

import asyncio
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
import jsonpatch
import kubernetes_validate
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
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
    pod = jsonpatch.apply_patch(review["request"]["object"], ops)
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
    pod = jsonpatch.apply_patch(review["request"]["object"], ops)
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
    patched = jsonpatch.apply_patch(review["request"]["object"], ops)
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
    pod = jsonpatch.apply_patch(
        review["request"]["object"], json.loads(base64.b64decode(out["patch"]))
    )
    (sidecar,) = pod["spec"]["initContainers"]
    assert sidecar["args"][-2:] == ["--tokenizer", "/shared/models/base"]
    (mount,) = sidecar["volumeMounts"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert mount["readOnly"] and volume["persistentVolumeClaim"] == {
        "claimName": "harnessrl-shared", "readOnly": True}  # fmt: skip
    assert not any(c.get("volumeMounts") for c in pod["spec"]["containers"])  # the harness: none
    again = review_response({**review, "request": {**review["request"], "object": pod}}, spec)
    assert "patch" not in again["response"]  # reinvocation adds nothing twice


def _call(
    app: Any, chunks: list[bytes], headers: list[tuple[bytes, bytes]]
) -> tuple[int, Any, int]:
    """POST /mutate straight into the ASGI app: status, JSON body, and the chunks it read."""
    read = 0
    sent: dict[str, Any] = {}

    async def receive() -> dict[str, Any]:
        nonlocal read
        read += 1
        more = read < len(chunks)
        return {"type": "http.request", "body": chunks[read - 1], "more_body": more}

    async def send(message: dict[str, Any]) -> None:
        sent.setdefault(message["type"], message)

    scope = {"type": "http", "method": "POST", "path": "/mutate", "raw_path": b"/mutate",
             "query_string": b"", "headers": headers, "http_version": "1.1", "scheme": "http",
             "server": ("127.0.0.1", 443), "client": ("127.0.0.1", 1), "root_path": ""}  # fmt: skip
    asyncio.run(app(scope, receive, send))
    status = sent["http.response.start"]["status"]
    return status, json.loads(sent["http.response.body"]["body"]), read


def test_reviews_past_the_api_servers_body_cap_are_refused_unread() -> None:
    """A 200 MB review was read whole (791 MiB peak): now 413 at 3 MiB, with or without a length."""
    app = create_app(SPEC)
    chunk = b" " * (1 << 20)
    status, body, read = _call(app, [chunk] * 200, [(b"content-length", b"209715200")])
    assert (status, read) == (413, 0) and "3145728 bytes" in body["error"]
    status, body, read = _call(app, [chunk] * 200, [])  # chunked: read up to the cap only
    assert (status, read) == (413, 4) and "AdmissionReview over" in body["error"]
    review = json.dumps(load("pod_job_labelled.json")).encode()
    status, body, _ = _call(app, [review[:100], review[100:]], [])
    assert status == 200 and body["response"]["allowed"] is True


def test_deep_or_malformed_reviews_get_a_well_formed_answer() -> None:
    """Never a plain-text 500: a 400 with a JSON reason, or a denial for an opted-in pod."""
    client = TestClient(create_app(SPEC), raise_server_exceptions=False)
    for content in (b"[" * 100_000, b"\xff\xfe", b'{"kind": "AdmissionReview"}', b"[]"):
        r = client.post("/mutate", content=content)
        assert r.status_code == 400 and isinstance(r.json()["error"], str), content[:20]
    review = load("pod_job_labelled.json")
    review["request"]["object"]["spec"]["x"] = json.loads("[" * 900 + "]" * 900)
    r = client.post("/mutate", content=json.dumps(review))  # parses, too deep to copy
    assert r.status_code == 200
    resp = r.json()["response"]
    assert resp["allowed"] is False and "too deeply" in resp["status"]["message"]
    review["request"]["kind"] = "Pod"  # a string where an object belongs: not a pod review
    r = client.post("/mutate", content=json.dumps(review))
    assert r.status_code == 200 and r.json()["response"]["allowed"] is True


KEYS = st.sampled_from(
    ["c", "OPENAI_BASE_URL", "harnessrl-store", "kube-api-access-x", SIDECAR_NAME]
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2) | KEYS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=8,
)


def shaped(**fields: Any) -> Any:
    """An object with some of `fields`, or any JSON value in its place."""
    return st.fixed_dictionaries({}, optional=fields) | JSON


def items(of: Any) -> Any:
    return st.lists(of, max_size=3) | JSON


NAMED = shaped(name=KEYS)
CONTAINER = shaped(
    name=KEYS,
    env=items(shaped(name=KEYS, value=JSON, valueFrom=shaped(secretKeyRef=NAMED))),
    envFrom=items(shaped(secretRef=NAMED)),
    volumeMounts=items(NAMED),
)
VOLUME = shaped(
    name=KEYS,
    secret=shaped(secretName=KEYS),
    projected=shaped(sources=items(shaped(secret=NAMED, serviceAccountToken=JSON))),
)


@settings(max_examples=400, deadline=None)
@given(
    spec=st.fixed_dictionaries(
        {"containers": st.lists(CONTAINER, max_size=3)},
        optional={
            "initContainers": items(CONTAINER),
            "volumes": items(VOLUME),
            "shareProcessNamespace": JSON,
        },
    ),
    annotations=JSON,
    sidecar=st.sampled_from(  # the second mounts a volume: the pod's own volumes are edited too
        [SPEC, SidecarSpec(tokenizer="/shared/models/base", shared_claim="harnessrl-shared")]
    ),
)
def test_any_opted_in_pod_is_injected_or_refused_with_a_reason(
    spec: dict[str, Any], annotations: Any, sidecar: SidecarSpec
) -> None:
    """Whatever shapes a pod's fields have: a patch that applies and puts the sidecar first (or
    keeps the one it has), or a denial that says why; never an exception."""
    pod = {"metadata": {"labels": {"harnessrl.io/inject": "true"}, "annotations": annotations},
           "spec": spec}  # fmt: skip
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
              "request": {"uid": "u", "kind": {"kind": "Pod"}, "operation": "CREATE",
                          "object": pod}}  # fmt: skip
    resp = review_response(review, sidecar)["response"]
    if not resp["allowed"]:
        assert resp["status"]["message"].startswith("harnessrl injection: ")
        return
    patched = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(resp["patch"])))
    inits = patched["spec"]["initContainers"]
    before = spec.get("initContainers")
    if any(isinstance(c, dict) and c.get("name") == SIDECAR_NAME for c in before or []):
        assert any(isinstance(c, dict) and c.get("name") == SIDECAR_NAME for c in inits)
    else:  # added first, so that the pod's own init containers can reach the model
        assert inits[0]["name"] == SIDECAR_NAME
    assert all(
        {"name": "OPENAI_BASE_URL", "value": f"{sidecar.url}/v1"} in c["env"]
        for c in patched["spec"]["containers"]
    )
    assert patched["spec"]["automountServiceAccountToken"] is False
