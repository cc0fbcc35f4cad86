"""`weight_push=http` into real vLLM (opt-in): its workers stream the trainer's export into vLLM's
in-place reload through the worker extension harnessrl/serve/weight_fetch.py.

Needs HARNESSRL_VLLM_PYTHON=.venv-vllm/bin/python (`make vllm-env`) and the converted SmolLM2
folders the real-vLLM tier of test_weight_sync.py caches in that environment.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from harnessrl.fleet.export_server import ExportServer
from harnessrl.fleet.weight_sync import VLLMSync, VLLMSyncConfig

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = os.environ.get("HARNESSRL_VLLM_PYTHON")
CACHE = Path(str(VLLM_PY)).absolute().parent.parent / "harnessrl-cache"


@pytest.mark.vllm
@pytest.mark.timeout(3000)  # vLLM's compile warm-up takes minutes on a small CPU
@pytest.mark.skipif(
    not VLLM_PY or not (CACHE / "smollm2-b-layer3x4" / "config.json").is_file(),
    reason="real vLLM tier: HARNESSRL_VLLM_PYTHON=.venv-vllm/bin/python, after test_weight_sync's "
    "real-vLLM test has converted SmolLM2",
)
def test_vllm_workers_stream_pushed_weights_from_the_trainer(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = tmp_path / "weights"
    root.mkdir()
    shutil.copytree(CACHE / "smollm2-b-layer3x4", root / "v000001")
    shutil.copytree(CACHE / "smollm2-a", root / "v000002")
    log = (tmp_path / "vllm.log").open("w")
    proc = subprocess.Popen(
        [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model",
         str(CACHE / "smollm2-a"), "--served-model-name", "smollm2", "--dtype", "bfloat16",
         "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port),
         "--worker-extension-cls", "harnessrl.serve.weight_fetch.WeightFetch"],
        env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
             "PYTHONPATH": str(ROOT)},
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url, source = f"http://127.0.0.1:{port}", ExportServer(root)
    try:
        deadline = time.monotonic() + 1500
        while True:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "vLLM did not start in 25 minutes"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(5)

        def greedy() -> str:
            r = httpx.post(
                f"{url}/v1/completions",
                json={"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 16,
                      "temperature": 0},
                timeout=300,
            )  # fmt: skip
            return str(r.json()["choices"][0]["text"])

        out_a = greedy()
        sync = VLLMSync(VLLMSyncConfig(urls=(url,)), source=source)
        sync.push(root / "v000001", 1)
        out_b = greedy()
        assert httpx.get(f"{url}/weight_info").json() == {"weight_version": "1"}
        sync.push(root / "v000002", 2)
        assert out_b != out_a and greedy() == out_a
        print(f"vllm http push: {sync.last_push_s}")
    finally:
        source.stop()
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
