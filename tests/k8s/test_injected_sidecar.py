"""The harness pod's sidecar, run exactly as the webhook (or the launcher) configures it.

Its container's command, args and env come from the webhook's patch as the shipped webhook
Deployment's flags build it (and from the launcher's Job as the shipped train config wires it);
a harness asking for model "default" must reach a server that serves only "policy", as vLLM does
with the shipped --served-model-name.
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
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import uvicorn
import yaml

from harnessrl.config import load_config
from harnessrl.rollout.k8s import job_manifest
from harnessrl.rollout.tasks import RunSpec, Task
from harnessrl.traces import open_store
from harnessrl.train import pod_sidecar
from proxy_sidecar.inject import webhook
from proxy_sidecar.inject.webhook import SIDECAR_NAME, review_response

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "k8s" / "base"
SERVED = "policy"
TOKEN = "control-token-for-the-test"


def base_doc(file: str, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all((BASE / file).read_text()) if d and d["kind"] == kind]
    return doc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmLike:
    """A chat endpoint that serves one model name and 404s any other, as vLLM does."""

    def __init__(self) -> None:
        self.models: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.models.append(body.get("model"))
                if body.get("model") != SERVED:
                    msg = f"The model `{body.get('model')}` does not exist."
                    answer: dict[str, Any] = {"object": "error", "message": msg, "code": 404}
                    code = 404
                else:
                    code, answer = 200, completion("5")
                data = json.dumps(answer).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def completion(text: str) -> dict[str, Any]:
    return {
        "id": "cmpl-1", "object": "chat.completion", "created": 0, "model": SERVED,
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
    }  # fmt: skip


@pytest.fixture
def vllm() -> Iterator[VllmLike]:
    server = VllmLike()
    yield server
    server.server.shutdown()


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
    container: dict[str, Any], fields: dict[str, str], tmp: Path
) -> subprocess.Popen[bytes]:
    """Play kubelet: env from the Secrets and the downward API, $(VAR) in args expanded."""
    secrets = {"url": f"sqlite:///{tmp}/traces.db", "token": TOKEN}
    env: dict[str, str] = {}
    for e in container["env"]:
        ref = e.get("valueFrom", {})
        if "secretKeyRef" in ref:
            env[e["name"]] = secrets[ref["secretKeyRef"]["key"]]
        elif "fieldRef" in ref:  # the pod's own fields (downward API)
            env[e["name"]] = fields[ref["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = e["value"]
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in container["args"]]
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


def test_webhook_injected_sidecar_rewrites_the_model(
    vllm: VllmLike, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    spec = webhook_spec(vllm.url, port, monkeypatch)
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
    (sidecar,) = next(o["value"] for o in ops if o["path"] == "/spec/initContainers")
    assert sidecar["name"] == SIDECAR_NAME
    (harness_env,) = [o["value"] for o in ops if o["path"] == "/spec/containers/0/env"]
    proc = run_sidecar(sidecar, {"metadata.name": "my-harness-0"}, tmp_path)
    try:
        out = run_harness(harness_env)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "5", out.stderr
    assert vllm.models == [SERVED]
    store = open_store(f"sqlite:///{tmp_path}/traces.db")
    (call,) = store.calls("my-harness-0")
    assert call.status == 200


def test_launcher_job_sidecar_rewrites_the_model(vllm: VllmLike, tmp_path: Path) -> None:
    """The shipped train config's KubernetesLauncher Jobs: the same, through pod_sidecar."""
    cm = base_doc("train-config.yaml", "ConfigMap")
    f = tmp_path / "train.yaml"
    f.write_text(cm["data"]["train.yaml"])
    port = free_port()
    cfg = load_config(
        f,
        [
            f"rollout.servers={vllm.url}",
            f"rollout.kubernetes.sidecar.port={port}",
            # what the train Job passes from its Secret; the sidecar here writes to the test's store
            "rollout.store=postgresql://harnessrl@postgres/traces",
            "rollout.kubernetes.image=registry.example.com/harnessrl:1",
        ],
    )
    sidecar_spec = pod_sidecar(cfg)
    assert sidecar_spec.model == SERVED and sidecar_spec.upstream == vllm.url
    launcher_cfg = dataclasses.replace(cfg.rollout.kubernetes, sidecar=sidecar_spec)
    spec = RunSpec("r-1", Task("t", "2+3?"), "g", 0, "", 60.0)
    pod = job_manifest(spec, launcher_cfg)["spec"]["template"]
    (sidecar,) = pod["spec"]["initContainers"]
    (harness,) = pod["spec"]["containers"]
    fields = {f"metadata.annotations['{k}']": v for k, v in pod["metadata"]["annotations"].items()}
    proc = run_sidecar(sidecar, fields, tmp_path)
    try:
        out = run_harness(harness["env"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "5", out.stderr
    assert vllm.models == [SERVED]
