"""The harness pod's sidecar, run exactly as the webhook (or the launcher) configures it.

Its container's command, args, env and mounts come from the webhook's patch as the shipped webhook
Deployment's flags build it (and from the launcher's Job as the shipped train config wires it);
a harness asking for model "default" must reach a server that serves only "policy", as vLLM does
with the shipped --served-model-name, behind the shipped guard that asks every route for vLLM's
key: only the sidecar holds it. The sidecar serves token-in mode with the tokenizer folder on the
shared claim.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonpatch
import pytest
import uvicorn
import yaml
from guarded_vllm import KEY, SERVED, GuardedVllm

from harnessrl.config import load_config
from harnessrl.pods.k8s import job_manifest
from harnessrl.rollout.tasks import RunSpec, Task
from harnessrl.stack import pod_sidecar
from harnessrl.traces import open_store
from harnessrl.traces.schema import EndpointKind
from proxy_sidecar.dialects.tokens import load_tokenizer
from proxy_sidecar.inject import webhook
from proxy_sidecar.inject.webhook import SIDECAR_NAME, review_response

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "k8s" / "base"
TOKEN = "control-token-for-the-test"


def base_doc(file: str, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all((BASE / file).read_text()) if d and d["kind"] == kind]
    return doc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def vllm() -> Iterator[GuardedVllm]:
    server = GuardedVllm()
    yield server
    server.stop()


def webhook_spec(upstream: str, port: int, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The SidecarSpec the shipped webhook Deployment's flags build (upstream, port: the test's)."""
    deployment = base_doc("webhook.yaml", "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = [a for a in container["args"] if not a.startswith(("--upstream=", "--sidecar-port="))]
    seen: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn.Server, "run", lambda server: seen.update(s=server.config.app))
    webhook.main([*args, f"--upstream={upstream}", f"--sidecar-port={port}"])
    return seen["s"].state.spec


def run_sidecar(
    container: dict[str, Any], pod: dict[str, Any], fields: dict[str, str], tmp: Path
) -> subprocess.Popen[bytes]:
    """Play kubelet: env from the Secrets and the downward API, $(VAR) in args expanded, each
    volume the container mounts at its own folder under `tmp` (a claim: `tmp/CLAIM`)."""
    secrets = {
        "harnessrl-store": {"url": f"sqlite:///{tmp}/traces.db"},
        "harnessrl-control": {"token": TOKEN},
        "harnessrl-vllm": {"api-key": KEY},
    }
    env: dict[str, str] = {}
    for e in container["env"]:
        ref = e.get("valueFrom", {})
        if "secretKeyRef" in ref:
            env[e["name"]] = secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
        elif "fieldRef" in ref:  # the pod's own fields (downward API)
            env[e["name"]] = fields[ref["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = e["value"]
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    mounts = {}
    for m in container.get("volumeMounts", []):
        claim = volumes[m["name"]]["persistentVolumeClaim"]
        assert m["readOnly"] and claim["readOnly"], m  # the sidecar only reads the share
        mounts[m["mountPath"]] = str(tmp / claim["claimName"])
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in container["args"]]
    for path, local in mounts.items():
        args = [re.sub(rf"^{re.escape(path)}(?=/|$)", local, a) for a in args]
    assert container["command"][0] == "python"
    argv = [sys.executable, *container["command"][1:], *args]
    log = (tmp / "sidecar.log").open("wb")
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=log)
    port = container["ports"][0]["containerPort"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the startup probe: a TCP connect
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            assert proc.poll() is None, (tmp / "sidecar.log").read_text()
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("the sidecar never opened its port")


def shared_tokenizer(tmp: Path, folder: str) -> None:
    """The served model's tokenizer, as an HF folder on the shared claim (`folder` under /shared)."""
    try:
        tok = load_tokenizer("tiny")  # SmolLM2's, as the dialect tests load it (read once)
    except ValueError as err:
        pytest.skip(f"needs the shipped SmolLM2 tokenizer: {err}")
    tok.save(tmp / "harnessrl-shared" / folder.removeprefix("/shared/"))


def run_harness(env: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    values = {e["name"]: e["value"] for e in env if "value" in e}
    argv = [sys.executable, str(ROOT / "examples" / "answer_agent.py"), "--question", "2+3?"]
    return subprocess.run(
        argv, env={**os.environ, **values}, capture_output=True, text=True, timeout=120
    )


def test_shipped_names_agree() -> None:
    vllm_args = base_doc("vllm.yaml", "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    assert f"--served-model-name={SERVED}" in vllm_args["args"]
    hook = base_doc("webhook.yaml", "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert f"--model={SERVED}" in hook["args"]


def injected_pod(spec: Any) -> dict[str, Any]:
    """A labelled pod as the API server stores it after the webhook's patch."""
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "my-harness-0", "labels": {"harnessrl.io/inject": "true"}},
        "spec": {"containers": [{"name": "harness", "image": "reg/harness:1"}]},
    }  # fmt: skip
    review = {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "u1", "kind": {"kind": "Pod"}, "operation": "CREATE", "object": pod},
    }  # fmt: skip
    ops = json.loads(base64.b64decode(review_response(review, spec)["response"]["patch"]))
    patched: dict[str, Any] = jsonpatch.apply_patch(pod, ops)
    return patched


def test_webhook_injected_sidecar_rewrites_the_model_and_holds_the_key(
    vllm: GuardedVllm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    pod = injected_pod(webhook_spec(vllm.url, port, monkeypatch))
    (sidecar,) = pod["spec"]["initContainers"]
    (harness,) = pod["spec"]["containers"]
    assert sidecar["name"] == SIDECAR_NAME
    shared_tokenizer(tmp_path, "/shared/models/base")  # what the webhook's --tokenizer names
    proc = run_sidecar(sidecar, pod, {"metadata.name": "my-harness-0"}, tmp_path)
    try:
        out = run_harness(harness["env"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "5", out.stderr
    # The harness calling vLLM itself, with all it holds: refused.
    env = {e["name"]: e["value"] for e in harness["env"]}
    bypass = httpx.post(
        f"{vllm.url}/v1/chat/completions", timeout=10,
        headers={"Authorization": f"Bearer {env['OPENAI_API_KEY']}"},
        json={"model": SERVED, "messages": [{"role": "user", "content": "2+3?"}]},
    )  # fmt: skip
    assert bypass.status_code == 401
    assert [body["model"] for _, body in vllm.calls] == [SERVED]  # the bypass never got past
    store = open_store(f"sqlite:///{tmp_path}/traces.db")
    (call,) = store.calls("my-harness-0")
    assert call.status == 200


def test_webhook_injected_sidecar_serves_token_in_responses(
    vllm: GuardedVllm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/v1/responses through the injected sidecar: rendered with the shared folder's tokenizer
    and sent to vLLM as a token-id completions prompt, recorded as a Responses call."""
    port = free_port()
    pod = injected_pod(webhook_spec(vllm.url, port, monkeypatch))
    (sidecar,) = pod["spec"]["initContainers"]
    shared_tokenizer(tmp_path, "/shared/models/base")
    proc = run_sidecar(sidecar, pod, {"metadata.name": "my-harness-1"}, tmp_path)
    try:
        base = next(e["value"] for e in pod["spec"]["containers"][0]["env"]
                    if e["name"] == "OPENAI_BASE_URL")  # fmt: skip
        reply = httpx.post(
            f"{base}/responses", timeout=60, headers={"Authorization": "Bearer harnessrl"},
            json={"model": "default", "input": "What is 2+3?", "max_output_tokens": 4},
        )  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["object"] == "response"
    ((path, body),) = vllm.calls
    assert path == "/v1/completions" and body["model"] == SERVED
    assert body["prompt"] and all(isinstance(i, int) for i in body["prompt"])  # token in
    (call,) = open_store(f"sqlite:///{tmp_path}/traces.db").calls("my-harness-1")
    assert call.ok and call.endpoint is EndpointKind.COMPLETIONS
    assert call.response is not None and call.response["dialect"] == "responses"
    assert list(call.prompt_token_ids) == body["prompt"]


def test_launcher_job_sidecar_rewrites_the_model(vllm: GuardedVllm, tmp_path: Path) -> None:
    """The shipped train config's KubernetesLauncher Jobs: the same, through pod_sidecar, which
    hands the sidecars serve.model's tokenizer folder on the shared claim."""
    cm = base_doc("train-config.yaml", "ConfigMap")
    f = tmp_path / "train.yaml"
    f.write_text(cm["data"]["train.yaml"])
    port = free_port()
    share = tmp_path / "harnessrl-shared"  # the claim, where the learner and the sidecars see it
    overrides = [
        f"rollout.servers={vllm.url}",
        f"rollout.kubernetes.sidecar.port={port}",
        # what the train Job passes from its Secret; the sidecar here writes to the test's store
        "rollout.store=postgresql://harnessrl@postgres/traces",
        "rollout.kubernetes.image=registry.example.com/harnessrl:1",
        f"rollout.kubernetes.sidecar.shared_path={share}",
        f"serve.model={share}/models/base",
    ]
    cfg = load_config(f, overrides)
    assert cfg.rollout.kubernetes.sidecar.shared_claim == "harnessrl-shared"
    assert pod_sidecar(cfg).tokenizer == ""  # no tokenizer in that folder yet: token-in off
    shared_tokenizer(tmp_path, "/shared/models/base")
    sidecar_spec = pod_sidecar(cfg)
    assert sidecar_spec.model == SERVED and sidecar_spec.upstream == vllm.url
    assert sidecar_spec.upstream_key_secret == "harnessrl-vllm"
    assert sidecar_spec.tokenizer == cfg.serve.model
    unshared = dataclasses.replace(cfg.rollout.kubernetes.sidecar, shared_claim="")
    assert pod_sidecar(dataclasses.replace(cfg, rollout=dataclasses.replace(
        cfg.rollout, kubernetes=dataclasses.replace(cfg.rollout.kubernetes, sidecar=unshared)
    ))).tokenizer == ""  # a folder the pods cannot mount is not handed to them  # fmt: skip
    launcher_cfg = dataclasses.replace(cfg.rollout.kubernetes, sidecar=sidecar_spec)
    spec = RunSpec("r-1", Task("t", "2+3?"), "g", 0, "", 60.0)
    pod = job_manifest(spec, launcher_cfg)["spec"]["template"]
    (sidecar,) = pod["spec"]["initContainers"]
    (harness,) = pod["spec"]["containers"]
    assert sidecar["args"][sidecar["args"].index("--tokenizer") + 1] == cfg.serve.model
    fields = {f"metadata.annotations['{k}']": v for k, v in pod["metadata"]["annotations"].items()}
    proc = run_sidecar(sidecar, pod, fields, tmp_path)
    try:
        out = run_harness(harness["env"])
        base = next(e["value"] for e in harness["env"] if e["name"] == "OPENAI_BASE_URL")
        reply = httpx.post(f"{base}/responses", timeout=60,
                           json={"model": "x", "input": "2+3?", "max_output_tokens": 4})  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "5", out.stderr
    assert reply.status_code == 200, reply.text  # token-in, with the shared folder's tokenizer
    assert [(path, body["model"]) for path, body in vllm.calls] == [
        ("/v1/chat/completions", SERVED), ("/v1/completions", SERVED)]  # fmt: skip
